"""The gate: what a candidate must pass to be promoted, and the [eval] section that configures it.

Every rule compares the candidate, on one data set and one metric, with one anchor:

- `service`: the adapter in service (what the candidate was trained from): the per-night limit;
- `reference`: the best promoted version so far (the base model until one is promoted), measured on
  the same data the same night: the cumulative limit. A version becomes the reference when it is
  promoted and at least as good on the regression set (exact match, then token accuracy) as the
  reference was; so the anchor never slides down with the service, and small steps of
  forgetting that each pass the per-night limit cannot add up past the cumulative one;
- `base`: the base model without any adapter.

The defaults protect tasks, not a loss: the answers of earlier nights (the regression set grows by
itself from their held-out samples) must not lose more than 5 points of exact match or of reply
token accuracy (or one sample's worth, on a set too small for 5 points to be a sample), per night
and in total. Loss percentages are opt-in: a learned answer's loss is
near zero (~0.02 nats), where a percentage of it is noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jobs.contract import GateCheck, GateResult, Losses

EvalSet = Literal["heldout", "regression"]
Metric = Literal["loss", "perplexity", "token_accuracy", "exact_match"]
Against = Literal["service", "reference", "base"]
HIGHER_IS_BETTER = {"token_accuracy", "exact_match"}  # loss and perplexity: lower is better
# where each anchor's figures are in the metrics ("<data>_<stage>")
STAGE = {"service": "before", "reference": "reference", "base": "base"}


class GateRule(BaseModel):
    """[[eval.gate]]: one check of the candidate against an anchor (same data, same night).

    ```toml
    [[eval.gate]]
    data = "regression"       # heldout (tonight's new samples kept out of training) | regression
    metric = "exact_match"    # loss | perplexity | token_accuracy | exact_match (of the reply)
    against = "reference"     # service (per night) | reference (best promoted so far: cumulative) | base
    max_worse = 0.05          # may drop by at most 0.05 (5 points of exact match)
    ```
    """

    model_config = ConfigDict(extra="forbid")
    data: EvalSet
    metric: Metric = "loss"
    against: Against = "service"
    max_worse_pct: float | None = Field(
        None, ge=-100, description="may get worse by at most this % of the anchor's value; negative: must improve")
    max_worse: float | None = Field(None, description="may get worse by at most this much, in the metric's units")
    limit: float | None = Field(None, description="bound on the candidate: loss/perplexity <= limit, "
                                "token_accuracy/exact_match >= limit")
    max_worse_samples: int = Field(0, ge=0, description="token_accuracy/exact_match may also drop by this many "
                                   "samples' worth (n / samples in the set): on a small set one answer is many points")
    required: bool = Field(False, description="fail (not skip) when this data set is missing or not evaluated")

    @field_validator("metric", mode="before")
    @classmethod
    def _accuracy_is_token_accuracy(cls, v: Any) -> Any:
        return "token_accuracy" if v == "accuracy" else v  # the first versions' name

    @model_validator(mode="after")
    def _has_a_threshold(self) -> GateRule:
        if self.max_worse_pct is None and self.max_worse is None and self.limit is None:
            raise ValueError("give at least one of max_worse_pct, max_worse, limit")
        return self

    @property
    def name(self) -> str:
        base = f"{self.data}.{self.metric}"
        return base if self.against == "service" else f"{base} vs {self.against}"

    def describe(self) -> str:
        parts = []
        if self.max_worse_pct is not None:
            parts.append(f"worse by <= {self.max_worse_pct:g}%")
        if self.max_worse is not None:
            parts.append(f"worse by <= {self.max_worse:g}")
            if self.max_worse_samples and self.metric in HIGHER_IS_BETTER:
                parts[-1] += f" or {self.max_worse_samples} sample{'s' if self.max_worse_samples > 1 else ''}"
        if self.limit is not None:
            parts.append(f"{'>=' if self.metric in HIGHER_IS_BETTER else '<='} {self.limit:g}")
        return ", ".join(parts)


def default_rules() -> list[GateRule]:
    """Per night against the adapter in service, and cumulatively against the reference."""
    return [GateRule(data="regression", metric=metric, against=against, max_worse=0.05, max_worse_samples=1)
            for against in ("service", "reference") for metric in ("exact_match", "token_accuracy")]


class EvalConfig(BaseModel):
    """[eval]: what is measured and what the candidate must pass to be promoted.

    The two `max_*_increase_pct` keys are shorthands for loss rules against the adapter in
    service (kept from the first version of the config); `[[eval.gate]]` rules are checked in
    addition and replace the default rules when given.
    """

    model_config = ConfigDict(extra="forbid")
    regression_set: Path | None = None  # an extra fixed file of records that must not get worse
    max_regression_increase_pct: float | None = Field(
        None, ge=0, description="regression loss may rise at most this % per night (None: not gated)")
    max_heldout_increase_pct: float | None = Field(
        None, ge=0, description="held-out loss may rise at most this % per night (None: not gated)")
    gate: list[GateRule] = Field(default_factory=default_rules, description="the rules, all must pass")
    max_eval_samples: int = Field(512, ge=1, description="cap per set, to bound evaluation time")
    max_tokens_per_batch: int = Field(8192, ge=16)
    min_eval_samples: int = Field(8, ge=1, description="a set with fewer samples is 'not evaluated'")
    regression_per_slice: int = Field(
        32, ge=0, description="held-out samples of one night and one source kept in the regression set")

    def rules(self) -> list[GateRule]:
        shorthand = [GateRule(data=d, metric="loss", max_worse_pct=pct)
                     for d, pct in (("regression", self.max_regression_increase_pct),
                                    ("heldout", self.max_heldout_increase_pct)) if pct is not None]
        return shorthand + list(self.gate)


Measured = dict[str, dict[str, float] | None]  # "<data>_<before|after|reference|base>" -> metrics


def gate(losses: Losses, cfg: EvalConfig, metrics: Measured | None = None, *,
         not_evaluated: dict[str, str] | None = None) -> GateResult:
    """Promote only if every rule passes. `metrics` maps "<data>_<stage>" to {"loss", "perplexity",
    "token_accuracy", "exact_match"}; without it the losses alone serve the rules against the service.
    A rule whose data is missing or not evaluated is skipped (and recorded so) unless `required`:
    then it fails."""
    checks = []
    for rule in cfg.rules():
        before = _value(rule, STAGE[rule.against], losses, metrics)
        after = _value(rule, "after", losses, metrics)
        if before is None or after is None:
            why = (not_evaluated or {}).get(rule.data)
            checks.append(GateCheck(name=rule.name, against=rule.against, before=before, after=after, change=None,
                                    change_pct=None, rule=rule.describe(), passed=not rule.required,
                                    skipped=f"not evaluated: {why}" if why else
                                    f"no {rule.data} {rule.metric} measured"))
            continue
        samples = ((metrics or {}).get(f"{rule.data}_after") or {}).get("samples")
        checks.append(_check(rule, before, after, samples))
    return GateResult(passed=all(c.passed for c in checks), checks=checks)


def _value(rule: GateRule, stage: str, losses: Losses, metrics: Measured | None) -> float | None:
    key = f"{rule.data}_{stage}"
    measured = (metrics or {}).get(key)
    if measured:
        return measured.get(rule.metric)
    loss = getattr(losses, key, None)
    if loss is None or rule.metric in HIGHER_IS_BETTER:
        return None
    return loss if rule.metric == "loss" else math.exp(min(loss, 700.0))


def _check(rule: GateRule, before: float, after: float, samples: float | None = None) -> GateCheck:
    worse = (before - after) if rule.metric in HIGHER_IS_BETTER else (after - before)  # > 0: got worse
    ok = True
    if rule.max_worse_pct is not None:
        ok &= worse <= abs(before) * rule.max_worse_pct / 100
    if rule.max_worse is not None:
        allowed = rule.max_worse
        if rule.max_worse_samples and samples and rule.metric in HIGHER_IS_BETTER:
            allowed = max(allowed, rule.max_worse_samples / samples)
        ok &= worse <= allowed + 1e-12  # exact at the limit: 0.85 - 0.80 is 0.0500000001 in floats
    if rule.limit is not None:
        ok &= after >= rule.limit if rule.metric in HIGHER_IS_BETTER else after <= rule.limit
    change_pct = (after - before) / abs(before) * 100 if before else None
    return GateCheck(name=rule.name, against=rule.against, before=before, after=after, change=after - before,
                     change_pct=change_pct, rule=rule.describe(), passed=bool(ok))


def at_least_as_good(candidate: dict[str, float] | None, reference: dict[str, float] | None) -> bool:
    """Does the candidate replace the reference? Exact match, then token accuracy, on the regression set;
    with nothing to compare (no regression set yet) a promoted candidate does."""
    if not candidate or not reference:
        return True
    key = ("exact_match", "token_accuracy")
    cand = tuple(candidate.get(k, 0.0) for k in key)
    ref = tuple(reference.get(k, 0.0) for k in key)
    return cand >= ref
