"""The eval gate: configurable metrics and thresholds, old keys kept, every decision with its numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.contract import GateCheck, Losses
from jobs.evaluate import EvalConfig, GateRule, gate


def losses(**kw: float | None) -> Losses:
    return Losses(**kw)


def judge(*args: Any) -> tuple[bool, list[GateCheck]]:
    result = gate(*args)
    return result.passed, result.checks


def test_the_original_keys_still_gate_losses():
    cfg = EvalConfig()  # regression loss may rise 2 %, held-out not gated
    assert judge(losses(regression_before=1.0, regression_after=1.019, heldout_before=1, heldout_after=9), cfg)[0]
    ok, [check] = judge(losses(regression_before=1.0, regression_after=1.03), cfg)
    assert not ok and check.name == "regression.loss" and check.rule == "worse by <= 2%"
    assert check.change == pytest.approx(0.03) and check.change_pct == pytest.approx(3.0)
    cfg = EvalConfig(max_regression_increase_pct=None, max_heldout_increase_pct=0)
    ok, [check] = judge(losses(regression_before=1.0, regression_after=5, heldout_before=1.0, heldout_after=1.01), cfg)
    assert not ok and check.name == "heldout.loss"


def test_missing_data_is_skipped_and_recorded_unless_required():
    ok, [check] = judge(losses(), EvalConfig())  # no regression set configured
    assert ok and check.skipped == "no regression loss measured" and check.before is None
    cfg = EvalConfig(gate=[GateRule(data="regression", metric="loss", max_worse_pct=2, required=True)])
    ok, checks = judge(losses(), cfg)
    assert not ok and [c.passed for c in checks] == [True, False]


def test_accuracy_absolute_drop_perplexity_limit_and_must_improve():
    cfg = EvalConfig.model_validate(
        {
            "max_regression_increase_pct": None,
            "gate": [
                {"data": "heldout", "metric": "accuracy", "max_worse": 0.01},
                {"data": "regression", "metric": "perplexity", "limit": 20},
                {"data": "heldout", "metric": "loss", "max_worse_pct": -5},  # must improve by 5 %
            ],
        }
    )
    metrics = {
        "heldout_before": {"loss": 2.0, "accuracy": 0.50, "perplexity": math.exp(2.0)},
        "heldout_after": {"loss": 1.8, "accuracy": 0.495, "perplexity": math.exp(1.8)},
        "regression_before": {"loss": 2.9, "accuracy": 0.3, "perplexity": math.exp(2.9)},
        "regression_after": {"loss": 2.95, "accuracy": 0.3, "perplexity": math.exp(2.95)},
    }
    ok, checks = judge(losses(), cfg, metrics)
    assert ok and [c.name for c in checks] == ["heldout.accuracy", "regression.perplexity", "heldout.loss"]
    metrics["heldout_after"]["accuracy"] = 0.485  # dropped 1.5 points
    metrics["regression_after"]["perplexity"] = 21.0
    metrics["heldout_after"]["loss"] = 1.95  # improved, but by less than 5 %
    ok, checks = judge(losses(), cfg, metrics)
    assert not ok and [c.passed for c in checks] == [False, False, False]
    assert checks[1].rule == "<= 20" and checks[0].rule == "worse by <= 0.01"


def test_perplexity_from_losses_alone_and_accuracy_then_unmeasured():
    cfg = EvalConfig(
        max_regression_increase_pct=None,
        gate=[
            GateRule(data="heldout", metric="perplexity", limit=3.0),
            GateRule(data="heldout", metric="accuracy", max_worse=0),
        ],
    )
    ok, checks = judge(losses(heldout_before=1.0, heldout_after=1.05), cfg)
    assert ok and checks[0].after == pytest.approx(math.exp(1.05)) and checks[1].skipped


def test_a_rule_needs_a_threshold_and_names_are_checked():
    with pytest.raises(ValidationError, match="at least one of"):
        GateRule(data="heldout", metric="loss")
    with pytest.raises(ValidationError):
        EvalConfig.model_validate({"gate": [{"data": "train", "max_worse": 1}]})
