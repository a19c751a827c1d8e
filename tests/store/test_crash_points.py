"""A crash at every write point (issue 40): each declared crash point in turn, a restart, and then
0 samples lost, 0 trained twice, `current` on a verified version, `doctor` clean.

The points are those `jobs.contract.crashpoints.declare` registers when the night is imported (every
ledger transaction, the pull's file commit and move, quarantine and token-cache writes, the version's
write and rename, the ledger's record of it, `current`, hot-swap records). The test asserts that the
points it covered are exactly the declared ones: a new point without a trial fails it. Training
checkpoints inside the loop declare their own points (jobs/training) and are covered by their tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from jobs.store.ledger import Ledger
from tests.conftest import REPO, alpaca, write_jsonl
from tests.store.crash_harness import NIGHT_POINTS

pytestmark = [pytest.mark.slow, pytest.mark.long]

GOOD_A, GOOD_B = 8, 6  # valid records of a.jsonl and b.jsonl (c.jsonl: b's content under another name)


def _prepare(root, tiny_model) -> None:
    inbox = root / "inbox"
    write_jsonl(inbox / "a.jsonl", [*[alpaca(i) for i in range(GOOD_A)], '{"not": "a record"'])
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " (b)") for i in range(GOOD_B)])
    (inbox / "c.jsonl").write_bytes((inbox / "b.jsonl").read_bytes())
    cfg = {
        "state_dir": "@ROOT@/state",
        "model": {"path": str(tiny_model), "name": "tiny"},
        "sources": [{"name": "inbox", "inbox": "@ROOT@/inbox", "settle_seconds": 0, "move_processed": True}],
        "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2},
        "train": {"backend": "hf", "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "batch_size": 4,
                  "batching": "padded", "max_tokens_per_batch": 2048, "max_seq_length": 128,
                  "gradient_checkpointing": False},
        "eval": {"gate": []},  # every candidate promoted: the outcome does not hang on a resumed run's losses
        "hotswap": {"targets": [{"name": "announce", "kind": "command", "argv": ["true"]}]},
    }
    (root / "night.json").write_text(json.dumps(cfg))
    # a run a kill left open in an earlier window: the night closes it first (its samples pending again)
    led = Ledger(root / "state" / "ledger.sqlite")
    led.start_run("2026-11-20-stale", "2026-11-20", deadline=time.time() - 3600)
    led.close()


def test_a_night_killed_at_every_crash_point_restarts_with_nothing_lost_or_trained_twice(tmp_path, tiny_model):
    prepared, out = tmp_path / "prepared", tmp_path / "out"
    prepared.mkdir()
    out.mkdir()
    _prepare(prepared, tiny_model)
    r = subprocess.run([sys.executable, "-m", "tests.store.crash_harness", str(prepared), str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=7200)  # a hang only: 2,556 s at load ~15
    assert r.returncode == 0, r.stderr[-4000:]
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    declared = json.loads((out / "declared.json").read_text())
    ref, trials = results[0], results[1:]
    assert ref["first"] == "exited" and ref["first_outcome"] == "succeeded", ref
    # every declared point is reached by the reference night (else it could never be covered)
    reached = {p for p in ref["counts"] if p.startswith(NIGHT_POINTS)}  # the loop's own are killed elsewhere
    assert reached == set(declared), set(declared) ^ reached
    covered = {t["point"].partition("@")[0] for t in trials}
    assert covered == set(declared), f"not covered: {sorted(set(declared) - covered)}"
    print(f"{len(declared)} crash points, {len(trials)} trials: {sorted(declared)}")

    expected_samples = GOOD_A + GOOD_B
    for t in trials:
        where = f"killed at {t['point']}"
        assert t["first"] == "killed", f"{where}: the point was not reached ({t})"
        assert t["restart"] == "exited" and t["restart_outcome"] in ("succeeded", "skipped"), f"{where}: {t}"
        # 0 lost: every valid record is a sample, the bad one quarantined, every file read and moved
        assert len(t["samples"]) == expected_samples, f"{where}: {len(t['samples'])} samples"
        assert t["quarantined"] == 1 and t["inbox_left"] == ["c.jsonl"], f"{where}: {t}"
        # 0 trained twice: one version, every sample trained or held out by it, one night succeeded
        assert t["versions"] == [[1, "promoted"]], f"{where}: {t['versions']}"
        assert all(s["status"] in ("trained", "heldout") and s["version"] == 1 for s in t["samples"]), where
        assert sorted(s["status"] for s in t["samples"]) == sorted(s["status"] for s in ref["samples"]), where
        nights = [run for run in t["runs"] if run[0] == "2026-11-21"]
        assert [run[1] for run in nights].count("succeeded") == 1, f"{where}: {t['runs']}"
        assert ["2026-11-20", "failed"] in t["runs"] and all(run[1] != "running" for run in t["runs"]), where
        assert t["current"] == "tiny-v0001" and t["verified"] == 1, f"{where}: {t['current']} {t['verified']}"
        assert t["doctor_problems"] == [], f"{where}: {t['doctor_problems']}"
