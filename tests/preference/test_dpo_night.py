"""A whole preference night on the CPU (tiny model): pairs pulled, trained with DPO against the version in
service, the held-out pairs judged, a promoted version whose preference moved toward the chosen replies."""

from __future__ import annotations

from jobs.contract import GateResult
from jobs.night.preference import PairScores, judge_preferences, preference_checks
from jobs.training.loop import TrainResult
from jobs.training.loop_state import PreferenceDetail, TrainDetail
from tests.conftest import alpaca, run, write_jsonl


def pair(i: int) -> dict[str, str]:
    return {"prompt": f"Add {i} and {i + 1}.", "chosen": f"{i} + {i + 1} = {2 * i + 1}", "rejected": "I do not know."}


def test_a_dpo_night_trains_pairs_and_promotes_on_held_out_pairs(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "sft.jsonl", [alpaca(i) for i in range(200, 206)])  # the first night: supervised
    sft = run(make())
    assert sft["outcome"] == "succeeded", sft["error"]
    write_jsonl(inbox / "prefs.jsonl", [pair(i) for i in range(40)] + [alpaca(300)])
    cfg = make(train={"objective": "dpo", "dpo_beta": 0.1, "learning_rate": 5e-3, "epochs": 2},
               plan={"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2})
    s = run(cfg)
    assert s["outcome"] == "succeeded", s["error"]
    checks = {c["name"]: c for c in s["gate"]["checks"]}
    acc, margin = checks["heldout_pairs.reward_accuracy"], checks["heldout_pairs.margin"]
    assert acc["skipped"] is None and acc["after"] > 0.5 and margin["after"] > 0, checks
    assert s["gate"]["passed"] and s["promoted"]
    assert any(k.startswith("regression.") for k in checks)  # the regression rules judged it too
    assert s["trained_samples"] >= 30 and s["cut_samples"] == 1  # the supervised record stays pending
    assert s["preference_pairs"] == s["trained_samples"]


def test_a_night_that_moves_held_out_pairs_toward_rejected_is_not_promoted():
    worse = PairScores(beta=0.1, before=[1.0, 2.0, 0.5], after=[0.2, 2.5, -1.0])
    checks = {c.name: c for c in preference_checks(worse)}
    assert checks["heldout_pairs.reward_accuracy"].after == 1 / 3 and not checks["heldout_pairs.reward_accuracy"].passed
    assert not checks["heldout_pairs.margin"].passed
    result = TrainResult(trained_ids=[1], tokens=1, seconds=1, steps=1, mean_loss=0.1, stopped=None,
                         detail=TrainDetail(objective="dpo",
                                            preference=PreferenceDetail(heldout_pairs=worse.model_dump())))
    assert not judge_preferences(GateResult(passed=True), result).passed
    better = PairScores(beta=0.1, before=[0.0, 0.0], after=[1.0, 2.0])
    result.detail.preference = PreferenceDetail(heldout_pairs=better.model_dump())
    assert judge_preferences(GateResult(passed=True), result).passed
    # the supervised gate's verdict (a regression rule failed) is never overturned
    assert not judge_preferences(GateResult(passed=False), result).passed
    sft = TrainResult(trained_ids=[1], tokens=1, seconds=1, steps=1, mean_loss=0.1, stopped=None)
    assert judge_preferences(GateResult(passed=True), sft).checks == []


def test_preference_pairs_trained_are_counted():
    from prometheus_client import CollectorRegistry

    from daemon.metrics import NightshiftMetrics
    from jobs.contract import ResultEvent
    from tests.fixtures.metrics_samples import summary

    reg = CollectorRegistry()
    m = NightshiftMetrics(reg)
    m.on_event(ResultEvent(summary=summary(trained_samples=7, preference_pairs=7)))
    m.on_event(ResultEvent(summary=summary(run_id="2026-11-22-a1b2c4", version=4, trained_samples=5)))
    assert reg.get_sample_value("nightshift_preference_pairs_trained_total") == 7


def test_a_dpo_night_that_breaks_the_regression_set_is_not_promoted(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "sft.jsonl", [alpaca(i) for i in range(200, 260)])  # 12 held out: tomorrow's regression set
    sft = run(make(train={"epochs": 3}, plan={"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0,
                                             "heldout_share": 0.2}))
    assert sft["outcome"] == "succeeded" and sft["promoted"], sft["error"]
    write_jsonl(inbox / "prefs.jsonl", [pair(i) for i in range(30)])
    s = run(make(train={"objective": "dpo", "learning_rate": 0.5, "epochs": 2},  # a step far too large
                 plan={"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2}),
            night="2026-11-22")
    failed = [c["name"] for c in s["gate"]["checks"] if not c["passed"]]
    assert any(n.startswith("regression.") for n in failed), s["gate"]
    assert not s["gate"]["passed"] and not s["promoted"]
