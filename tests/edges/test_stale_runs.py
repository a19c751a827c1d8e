"""Issue 40: a run its window's end interrupted is closed before a later night trains; `doctor` names it."""

from __future__ import annotations

import time

from jobs.contract import Plan
from jobs.store.doctor import diagnose
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, run, write_jsonl

NIGHT = "2026-11-21"


def _stale_plan(led: Ledger, run_id: str, night: str, ids: list[int], *, deadline: float) -> None:
    """What the audit found: a run killed at the window's end, its old plan stored, still `running`."""
    led.start_run(run_id, night, deadline)
    plan = Plan(key="k", train_ids=ids, heldout_ids=[], train_tokens=10 * len(ids), deferred_samples=0,
                deferred_tokens=0, tokens_per_second=1000.0, overhead_seconds=0.0, available_seconds=100.0,
                predicted_train_seconds=1.0, epochs=1, basis="test", measured=False, version=1)
    led.save_plan(run_id, plan, plan.roles(), "tiny-v0001")


def test_a_run_whose_window_ended_is_closed_and_the_next_night_plans_from_the_ledger(night_env):
    inbox, make = night_env
    cfg = make()
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(12)])
    run(cfg, night="2026-11-19", seconds=0)  # ingests the 12 (no time to train them: skipped)
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    ids = [r.id for r in led.pending()]
    assert len(ids) == 12
    # the same night's label (a manual `once` in between, the service's next start): its window is over
    _stale_plan(led, "stale", NIGHT, ids[:3], deadline=time.time() - 60)
    found = {f.subject: f.text for f in diagnose(cfg.state_dir) if f.subject == "run"}
    assert "run stale of night 2026-11-21 is open" in found["run"] and "samples go back to pending" in found["run"]

    write_jsonl(inbox / "b.jsonl", [alpaca(i, " new") for i in range(4)])
    summary = run(cfg, night=NIGHT)
    stale = led.run("stale")
    assert stale["status"] == "failed" and "window ended" in stale["error"]
    assert summary["run_id"] != "stale" and summary["outcome"] == "succeeded"
    # planned afresh from the ledger as it is now: the 12 and the 4 new ones, not the stale plan's 3
    assert summary["trained_samples"] + summary["heldout_samples"] == 16
    assert [(v["version"], v["run_id"]) for v in led.versions()] == [(1, summary["run_id"])]  # the number reused
    assert not any(f.subject == "run" for f in diagnose(cfg.state_dir))


def test_a_run_inside_its_own_window_is_resumed_and_doctor_says_so(night_env):
    inbox, make = night_env
    cfg = make()
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(6)])
    run(cfg, night="2026-11-19", seconds=0)
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    ids = [r.id for r in led.pending()]
    _stale_plan(led, "open", NIGHT, ids, deadline=time.time() + 3600)
    found = [f.text for f in diagnose(cfg.state_dir) if f.subject == "run"]
    assert len(found) == 1 and "resumes it" in found[0]
    summary = run(cfg, night=NIGHT)
    assert summary["run_id"] == "open" and led.run("open")["status"] == "succeeded"
