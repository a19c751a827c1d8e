"""A preference night killed mid-training (SIGKILL at a training crash point: a counted step, a checkpoint being
written) resumes from its last checkpoint and trains every row of pairs exactly once: the same steps, loss
curve, ledger counts and weights as the same night never killed, promoted and gated as usual.

The nights run in processes forked from a forkserver that imported the night once (tests/preference/
dpo_kill_worker.py); checkpoints every step (checkpoint_every_seconds tiny), so the N-th time a point is reached
names the same step in every run, whatever the machine's load."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import hang_bound, write_jsonl

pytest.importorskip("torch")

CASES = ["train.counted@4", "train.checkpoint.written@3"]


def pair(i: int) -> dict[str, str]:
    return {"prompt": f"Add {i} and {i + 1}.", "chosen": f"{i} + {i + 1} = {2 * i + 1}", "rejected": "I do not know."}


@pytest.fixture(scope="module")
def forks():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.preference.dpo_kill_worker"])
    return ctx


def prepare(root: Path, tiny_model: Path) -> Path:
    from jobs.night.config import NightConfig

    inbox = root / "inbox"
    write_jsonl(inbox / "prefs.jsonl", [pair(i) for i in range(30)])
    cfg = NightConfig.model_validate({
        "state_dir": root / "state", "model": {"path": tiny_model, "name": "tiny"},
        "sources": [{"name": "inbox", "inbox": inbox, "settle_seconds": 0}],
        "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2},
        "train": {"backend": "hf", "objective": "dpo", "dpo_beta": 0.1, "learning_rate": 5e-3, "epochs": 2,
                  "lora_rank": 4, "lora_alpha": 8, "max_seq_length": 64, "max_tokens_per_batch": 128,
                  "gradient_checkpointing": False, "checkpoint_every_seconds": 1e-6}})
    (root / "night.json").write_text(cfg.model_dump_json())
    return root


def launch(forks, root: Path, crash_at: str | None) -> int | None:
    from tests.preference import dpo_kill_worker

    p = forks.Process(target=dpo_kill_worker.night, args=(str(root), crash_at))
    p.start()
    p.join(timeout=hang_bound(600))
    if p.is_alive():
        p.kill()
        pytest.fail(f"the night hung ({crash_at})")
    return p.exitcode


def outcome(root: Path) -> dict:
    """The summary, the ledger's sample statuses, the promoted adapter's weights and its manifest."""
    from safetensors.torch import load_file

    from jobs.store.registry import Registry

    assert (root / "summary.json").exists(), (root / "error.txt").read_text() if (root / "error.txt").exists() else ""
    s = json.loads((root / "summary.json").read_text())
    db = sqlite3.connect(root / "state" / "ledger.sqlite")
    statuses = sorted(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
    db.close()
    current = Registry(root / "state", create=False).current()
    assert current is not None, s
    manifest = json.loads((current / "manifest.json").read_text())
    return {"summary": s, "statuses": statuses, "weights": load_file(str(current / "adapter_model.safetensors")),
            "training": manifest["training"], "loss_curve": manifest["loss_curve"]}


@pytest.fixture(scope="module")
def reference(forks, tiny_model, tmp_path_factory):
    root = prepare(tmp_path_factory.mktemp("dpo-ref"), tiny_model)
    assert launch(forks, root, None) == 0
    return outcome(root)


@pytest.mark.slow
@pytest.mark.parametrize("point", CASES)
def test_a_dpo_night_killed_mid_training_resumes_and_trains_every_pair_once(forks, reference, tiny_model, tmp_path,
                                                                          point):
    root = prepare(tmp_path, tiny_model)
    assert launch(forks, root, point) == -signal.SIGKILL  # the point was reached, and the night died right there
    assert not (root / "summary.json").exists()
    assert launch(forks, root, None) == 0  # started again: the open run resumes
    got, ref = outcome(root), reference
    s, r = got["summary"], ref["summary"]
    assert r["steps"] >= 6 and r["promoted"] and r["outcome"] == "succeeded", r  # several rows, two epochs
    assert s["outcome"] == "succeeded" and s["promoted"] and s["gate"]["passed"], s
    assert got["training"]["resumed_from_step"] > 0  # it continued a checkpoint, not the run's start
    assert s["steps"] == r["steps"]  # every row's step counted once over both attempts
    assert got["loss_curve"] == ref["loss_curve"]  # each step once, in order (and the same losses)
    assert s["trained_samples"] == r["trained_samples"] == s["preference_pairs"] == r["preference_pairs"]
    assert got["statuses"] == ref["statuses"]  # the ledger: the same pairs trained, the held-out ones held out
    checks = {c["name"]: c for c in s["gate"]["checks"]}
    ref_checks = {c["name"]: c for c in r["gate"]["checks"]}
    # judged against the version in service as the first attempt saw it (kept), not the checkpoint's policy
    assert checks["heldout_pairs.margin"]["after"] == pytest.approx(ref_checks["heldout_pairs.margin"]["after"],
                                                                    abs=1e-4)
    for name, w in ref["weights"].items():  # a row trained twice or skipped moves weights by ~ the learning rate
        assert float((got["weights"][name] - w).abs().max()) < 1e-5, name
    shutil.rmtree(root / "state" / "models", ignore_errors=True)
