"""What an interrupted night says (issue 42): its samples are tonight's still, not deferred. A `once` stopped by
SIGTERM after one step printed "deferred 401" (the samples of the epoch it was in) for a plan that deferred none,
though the resumed night trains them."""

from __future__ import annotations

import threading

from tests.conftest import alpaca, run, write_jsonl
from tests.fixtures.night_events import StopAtProgress


def test_a_night_stopped_on_request_defers_nothing_the_plan_did_not(night_env):
    inbox, make = night_env
    cfg = make(eval={"min_eval_samples": 1}, plan={"heldout_share": 0.2}, train={"batch_size": 4, "epochs": 2})
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    stop = threading.Event()
    first = run(cfg, stop=stop, events=StopAtProgress(stop))
    assert first["outcome"] == "interrupted" and first["stopped"] == "signal"
    assert first["plan"]["deferred_samples"] == 0
    assert (first["deferred_samples"], first["cut_samples"]) == (0, 0)
    second = run(cfg)  # the same night resumed: every planned sample trained, none deferred
    assert second["run_id"] == first["run_id"] and second["outcome"] in ("succeeded", "rejected")
    assert second["deferred_samples"] == 0 and second["trained_samples"] == len(first["plan"]["train_ids"])


def test_a_night_resumed_with_less_time_shows_its_new_plan(night_env):
    """Resumed with a later --until that cannot hold the rest, the plan said "deferred 0" and "predicted 116 s"
    beside "time available 47 s", and the summary "trained 232,105 of 586,875 planned (40 %)". The rate here is
    the plan's own (a prior of 10 tok/s), so what fits is known whatever the machine's load."""
    inbox, make = night_env
    cfg = make(plan={"heldout_share": 0.2, "prior_tokens_per_second": 10}, eval={"min_eval_samples": 1},
               train={"batch_size": 4, "epochs": 2})
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    stop = threading.Event()
    first = run(cfg, stop=stop, events=StopAtProgress(stop))
    assert first["outcome"] == "interrupted" and first["trained_tokens"] > 0
    stored = first["plan"]
    total = stored["train_tokens"] * stored["epochs"]
    events: list[dict] = []
    second = run(cfg, seconds=30, events=events)
    plan = next(ev["plan"] for ev in events if ev["event"] == "plan")
    left = plan["available_seconds"]
    assert 0 < left <= 30 and plan["train_ids"] == stored["train_ids"]  # the same samples: the checkpoint's order
    fits = min(total - first["trained_tokens"], left * 10)
    assert fits < total - first["trained_tokens"]  # 30 s at 10 tok/s cannot hold the rest
    assert abs(plan["predicted_train_seconds"] - fits / 10) < 1e-6 and plan["predicted_train_seconds"] <= left
    assert 0 < plan["deferred_samples"] < len(stored["train_ids"]) and "resumed with" in plan["basis"]
    assert second["planned_tokens"] == first["trained_tokens"] + int(fits) < total
    assert second["deferred_samples"] == second["cut_samples"]  # what the loop cut, not the plan's estimate again



def test_the_plan_of_a_stopped_night_is_the_plan_its_resume_trains(night_env):
    """`nightshift plan` before resuming a stopped night planned afresh (another version, other samples: "1,315
    new, 109 deferred, 76 held out" where the resumed `once` then trained its stored 1,419 with 81 held out). It
    shows the stored plan with the time left now, and changes nothing (not even the run's attempt count)."""
    import time

    from jobs.night.run import run_night
    from jobs.store.ledger import Ledger
    from tests.night.test_plan_readonly import snapshot

    inbox, make = night_env
    cfg = make(eval={"min_eval_samples": 1}, plan={"heldout_share": 0.2}, train={"batch_size": 4, "epochs": 2})
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    stop = threading.Event()
    first = run(cfg, stop=stop, events=StopAtProgress(stop))
    assert first["outcome"] == "interrupted" and first["trained_tokens"] > 0
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " later") for i in range(5)])  # arrived since: not in the resume
    before = snapshot(cfg.state_dir)
    shown: list = []
    run_night(cfg, night="2026-11-21", deadline=time.time() + 3600, emit=shown.append, stop=threading.Event(),
              plan_only=True)
    assert snapshot(cfg.state_dir) == before
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    assert led.run(first["run_id"])["attempt"] == 1
    led.close()
    [plan] = [ev.plan for ev in shown if getattr(ev, "event", None) == "plan"]
    events: list[dict] = []
    second = run(cfg, events=events)
    trained = next(ev["plan"] for ev in events if ev["event"] == "plan")
    assert second["run_id"] == first["run_id"] and plan.version == first["version"] == trained["version"]
    for key in ("train_ids", "heldout_ids", "replay_ids", "train_tokens"):
        assert getattr(plan, key) == trained[key] == first["plan"][key], key
    assert f"{first['trained_tokens']:,} tokens trained before" in plan.basis
