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

