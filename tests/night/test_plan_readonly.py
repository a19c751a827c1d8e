"""`nightshift plan` changes nothing: no ingest, no quarantine file, no move, no run, not a byte of the
ledger; it plans over the pending samples plus what the inbox would add."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from jobs.data.pull import Quarantine, pull
from jobs.night.run import run_night
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, write_jsonl


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under the roots: size and mtime (SQLite's -wal/-shm companions are not data)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_plan_reads_pending_and_the_inbox_and_writes_nothing(night_env, tokenizer, tmp_path, order):
    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0, "move_processed": True}],
               plan={"heldout_share": 0, "replay_share": 0, "order": order})
    state = Path(cfg.state_dir)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    led = Ledger(state / "ledger.sqlite")
    pull(cfg.sources, led, tokenizer, run_id="r0", quarantine=Quarantine(state / "q0.jsonl"), max_seq_length=128,
         overlong="reject")  # 10 pending, a.jsonl moved to processed/
    assert led.sample_counts() == {"pending": 10} and (inbox / "processed" / "a.jsonl").exists()
    led.close()
    write_jsonl(inbox / "b.jsonl", [*(alpaca(i, " b") for i in range(8)), alpaca(3), "{broken", {"instruction": 1}])
    before = snapshot(state, inbox)

    s = run_night(cfg, night="plan", deadline=time.time() + 3600, emit=lambda _: None, stop=threading.Event(),
                  plan_only=True)

    assert snapshot(state, inbox) == before  # nothing ingested, quarantined, moved or recorded
    assert (inbox / "b.jsonl").exists() and not (state / "quarantine").exists()
    led = Ledger(state / "ledger.sqlite")
    assert led.sample_counts() == {"pending": 10} and led.last_runs() == [] and led.versions() == []
    led.close()
    assert s.plan is not None
    pending = sorted(i for i in s.plan.train_ids if i > 0)
    incoming = [i for i in s.plan.train_ids if i < 0]
    assert len(pending) == 10 and sorted(incoming) == list(range(-8, 0))  # b's 8 new; the 9th is a duplicate
    assert (s.plan.train_ids[0] > 0) == (order == "oldest")  # the inbox's samples are the newest
    assert s.files_ingested == 1 and s.ingested == {"inbox": 8} and s.duplicates == 1
    assert s.quarantined == {"invalid_json": 1, "wrong_type": 1}
