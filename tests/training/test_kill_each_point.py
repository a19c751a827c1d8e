"""Issue 46: a rank killed at any point of a step or a checkpoint, then the night resumed, trains every global
step exactly once and records it so, for one process and for two gloo ranks on the CPU.

Each case SIGKILLs one rank at a named crash point (jobs/contract/crashpoints.py: the N-th time it is reached,
so the same step in every run, whatever the machine's load), then resumes from the newest whole checkpoint as a
night does, and compares with the same run never killed: the same global steps counted once each (steps, the
loss curve's step numbers, tokens, trained samples) and the same weights (a step trained twice or skipped moves
them by about the learning rate). The ranks are forked from a forkserver that imported torch once.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from jobs.contract.crashpoints import POINTS  # noqa: E402
from tests.conftest import hang_bound  # noqa: E402
from tests.fixtures.ports import reserved_port  # noqa: E402
from tests.training import kill_worker  # noqa: E402

STEP_POINTS = ["train.backward", "train.reduced", "train.stepped", "train.counted"]
CHECKPOINT_POINTS = ["train.checkpoint.written", "train.checkpoint.rotated", "train.checkpoint.saved"]
NTH = {**{p: 3 for p in STEP_POINTS}, **{p: 2 for p in CHECKPOINT_POINTS}}  # mid-run: the other rank still waits
CASES = ([(1, 0, p) for p in STEP_POINTS + CHECKPOINT_POINTS if p != "train.reduced"]  # one process: no reduction
         + [(2, 0, p) for p in STEP_POINTS + CHECKPOINT_POINTS]
         + [(2, 1, p) for p in STEP_POINTS])  # rank 1 writes no checkpoint


@pytest.fixture(scope="module")
def forks():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.training.kill_worker"])
    return ctx


def launch(forks, out: Path, name: str, case: str, world: int, **spec) -> list[int]:
    """Every rank of one run; their exit codes (-9: killed by its crash point)."""
    with reserved_port() as port:  # nobody else's until rank 0's store has it (tests/fixtures/ports.py)
        procs = [forks.Process(target=kill_worker.run_rank,
                               args=(str(out), {"name": name, "case": case, "rank": r, "world": world, "port": port,
                                                **spec}))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=hang_bound(300))  # bounds a hang only (the collectives' own timeout is 120 s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{name}: a rank hung"
    return [p.exitcode for p in procs]


def result(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def reference(forks, tmp_path_factory):
    """The run never killed, for each world size."""
    out = tmp_path_factory.mktemp("reference")
    refs = {}
    for world in (1, 2):
        assert launch(forks, out, f"ref{world}", f"ref{world}", world) == [0] * world
        refs[world] = result(out, f"ref{world}"), torch.load(out / f"ref{world}-rank0.pt")
    return refs


def test_every_training_crash_point_is_killed_by_a_case():
    assert {p for p in POINTS if p.startswith("train.")} == {p for _, _, p in CASES}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "rank", "point"), CASES)
def test_a_rank_killed_at_each_point_resumes_to_every_global_step_exactly_once(forks, reference, tmp_path, world,
                                                                                 rank, point):
    case = f"w{world}-r{rank}-{point}"
    codes = launch(forks, tmp_path, "killed", case, world, crash=f"{point}@{NTH[point]}", crash_rank=rank)
    assert codes[rank] == -signal.SIGKILL, codes  # the point was reached, and the rank died right there
    for other in range(world):
        if other != rank:  # its next collective failed at once: no hang, a clean failure
            assert codes[other] == 1 and "error" in result(tmp_path, "killed", other), codes
    assert launch(forks, tmp_path, "resumed", case, world, resume=True) == [0] * world
    ref, ref_weights = reference[world]
    got = result(tmp_path, "resumed")
    assert got["resumed_checkpoint"] and got["resumed_from"] > 0  # it did resume, not start over
    assert got["stopped"] is None and got["batches_done"] == got["batches"] == ref["batches"]
    assert got["steps"] == ref["steps"]  # every global step counted once over both attempts
    assert got["loss_steps"] == list(range(1, ref["steps"] + 1))  # the record: each step once, in order
    assert got["tokens"] == ref["tokens"] and got["trained_ids"] == ref["trained_ids"] == list(range(12))
    weights = torch.load(tmp_path / "resumed-rank0.pt")
    diff = float((weights - ref_weights).abs().max())
    assert diff < 1e-6, diff  # trained exactly once: a step twice or none moves weights by ~1e-2
    for other in range(1, world):
        assert torch.equal(torch.load(tmp_path / f"resumed-rank{other}.pt"), weights)



@pytest.mark.slow
def test_a_retry_stopped_by_its_deadline_one_step_short_says_so_and_leaves_that_steps_samples_pending(
        forks, reference, tmp_path):
    """The issue's 59 of 60, as this test reproduces it: no kill point loses a step (above), but a retry whose
    window runs out before its last global step stops one short (the old daemon test's 300 s window, on a machine
    at load 10-17, after two start-ups). The record agrees: stopped "deadline", the position short of the end,
    and the samples of the step not trained left pending (not trained, not lost) for the next night."""
    ref, _ = reference[2]
    n = ref["steps"]
    assert launch(forks, tmp_path, "killed", "late", 2, crash="train.counted@3", crash_rank=1)[1] == -signal.SIGKILL
    assert launch(forks, tmp_path, "resumed", "late", 2, resume=True, late_after=n - 1) == [0, 0]
    got = result(tmp_path, "resumed")
    assert got["stopped"] == "deadline" and got["steps"] == n - 1 and got["loss_steps"] == list(range(1, n))
    assert got["resumed_from"] > 0 and got["batches_done"] < got["batches"] == ref["batches"]
    assert got["partial_ids"] and sorted(got["trained_ids"] + got["partial_ids"]) == list(range(12))

def test_a_checkpoint_whose_state_does_not_say_its_step_count_is_not_resumed_from(tmp_path):
    """A position without its step count (or a value of the wrong type) cannot prove the two agree: the checkpoint
    is skipped with the reason (the previous one, else the run's start), never resumed from a guess."""
    from jobs.store.files import sha256_file
    from jobs.training.checkpoints import CHECKSUMS, checkpoint_problem, read_state
    from jobs.training.loop_state import LoopState

    ck = tmp_path / "latest"
    ck.mkdir()
    (ck / "optimizer.pt").write_bytes(b"state")
    (ck / CHECKSUMS).write_text(json.dumps({"optimizer.pt": sha256_file(ck / "optimizer.pt")}))
    (ck / "state.json").write_text(json.dumps({"next_batch": 4}))
    assert "steps" in (checkpoint_problem(ck) or "")
    (ck / "state.json").write_text(json.dumps({"next_batch": 4, "steps": 2, "halved": "off"}))
    assert "halved" in (checkpoint_problem(ck) or "")
    (ck / "state.json").write_text(LoopState(next_batch=4, steps=2, loss_curve=[(1, float("nan")), (2, 1.5)])
                                   .model_dump_json())
    assert checkpoint_problem(ck) is None
    assert read_state(ck).loss_curve[1] == (2, 1.5)  # a NaN loss reads back (as NaN), the checkpoint stays usable
