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
