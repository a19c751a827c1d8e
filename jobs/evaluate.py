"""Evaluate: token-weighted loss, perplexity and next-token accuracy on held-out new samples
and on a fixed regression set, for the adapter in service (or the bare base) and for the
candidate; then the gate: configurable rules, each recorded with its numbers (manifest, log).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.contract import GateCheck, GateResult, Losses
from jobs.data.batching import IGNORE_INDEX, TokenizedSample, padded_batches
from jobs.data.formats import RecordError, normalise
from jobs.data.render import tokenize_record
from jobs.data.sources import read_records

EvalSet = Literal["heldout", "regression"]
Metric = Literal["loss", "perplexity", "accuracy"]
HIGHER_IS_BETTER = {"accuracy"}  # loss and perplexity: lower is better


class GateRule(BaseModel):
    """[[eval.gate]]: one check the candidate must pass against the adapter in service (same data).

    ```toml
    [[eval.gate]]
    data = "heldout"          # heldout (new samples kept out of training) | regression (the fixed set)
    metric = "accuracy"       # loss | perplexity | accuracy (next-token, on trained-on tokens)
    max_worse = 0.01          # may drop by at most 0.01 (absolute)
    ```
    """

    model_config = ConfigDict(extra="forbid")
    data: EvalSet
    metric: Metric = "loss"
    max_worse_pct: float | None = Field(
        None, ge=-100, description="may get worse by at most this % of the value before; negative: must improve")
    max_worse: float | None = Field(None, description="may get worse by at most this much, in the metric's units")
    limit: float | None = Field(None, description="bound on the candidate: loss/perplexity <= limit, accuracy >= limit")
    required: bool = Field(False, description="fail (not skip) when this data set is empty or missing")

    @model_validator(mode="after")
    def _has_a_threshold(self) -> GateRule:
        if self.max_worse_pct is None and self.max_worse is None and self.limit is None:
            raise ValueError("give at least one of max_worse_pct, max_worse, limit")
        return self

    @property
    def name(self) -> str:
        return f"{self.data}.{self.metric}"

    def describe(self) -> str:
        parts = []
        if self.max_worse_pct is not None:
            parts.append(f"worse by <= {self.max_worse_pct:g}%")
        if self.max_worse is not None:
            parts.append(f"worse by <= {self.max_worse:g}")
        if self.limit is not None:
            parts.append(f"{'>=' if self.metric in HIGHER_IS_BETTER else '<='} {self.limit:g}")
        return ", ".join(parts)


class EvalConfig(BaseModel):
    """[eval]: what is measured and what the candidate must pass to be promoted.

    The two `max_*_increase_pct` keys are shorthands for loss rules (kept from the first
    version of the config); `[[eval.gate]]` rules are checked in addition. Set a shorthand
    to nothing (env: empty) to drop it.
    """

    model_config = ConfigDict(extra="forbid")
    regression_set: Path | None = None  # a JSONL/JSON/CSV/Parquet file of records that must not get worse
    max_regression_increase_pct: float | None = Field(
        2.0, ge=0, description="regression loss may rise at most this (None: not gated)")
    max_heldout_increase_pct: float | None = Field(
        None, ge=0, description="held-out loss may rise at most this (None: not gated)")
    gate: list[GateRule] = Field(default_factory=list, description="further checks, all must pass")
    max_eval_samples: int = Field(512, ge=1, description="cap per set, to bound evaluation time")
    max_tokens_per_batch: int = Field(8192, ge=16)

    def rules(self) -> list[GateRule]:
        shorthand = [GateRule(data=d, metric="loss", max_worse_pct=pct)
                     for d, pct in (("regression", self.max_regression_increase_pct),
                                    ("heldout", self.max_heldout_increase_pct)) if pct is not None]
        return shorthand + list(self.gate)


def eval_metrics(model: Any, samples: Sequence[TokenizedSample], *, pad_id: int, device: str,
                 max_tokens_per_batch: int) -> dict[str, float] | None:
    """Token-weighted loss (the same weighting as training) and next-token accuracy, over the
    tokens the model is trained on; None when there is nothing to measure."""
    import torch

    from jobs.training.step import model_inputs

    if not samples:
        return None
    was_training = model.training
    model.eval()
    total, count, correct, logits_ok = 0.0, 0, 0, True
    with torch.no_grad():
        for b in padded_batches(samples, batch_size=64, max_tokens_per_batch=max_tokens_per_batch, pad_id=pad_id):
            n = sum(1 for row in b.labels for x in row[1:] if x != IGNORE_INDEX)  # HF shifts labels by one
            if n == 0:
                continue
            t = model_inputs(b, device)
            out = model(**t)
            total += float(out.loss) * n
            count += n
            labels = t["labels"][:, 1:]
            logits = getattr(out, "logits", None)
            # fused-loss kernels may drop them (Unsloth returns a function instead of a tensor)
            if not isinstance(logits, torch.Tensor) or logits.shape[:2] != t["labels"].shape:
                logits_ok = False
                continue
            hits = (logits[:, :-1].argmax(-1) == labels) & (labels != IGNORE_INDEX)
            correct += int(hits.sum())
    if was_training:
        model.train()
    if not count:
        return None
    loss = total / count
    out_metrics = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    if logits_ok:
        out_metrics["accuracy"] = correct / count
    return out_metrics


def load_regression_set(path: Path, tokenizer: Any, *, max_seq_length: int, limit: int,
                        cache_dir: Path) -> list[TokenizedSample]:
    """A fixed file of records; invalid ones are an operator error, reported with file and line."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"[eval] regression_set: {path} does not exist")
    out: list[TokenizedSample] = []
    for raw in read_records(Path(path), cache_dir):
        try:
            if raw.error:
                raise raw.error
            norm = normalise(raw.record)
            out.append(tokenize_record(tokenizer, -len(out) - 1, norm.record, max_seq_length=max_seq_length,
                                       overlong="truncate"))
        except RecordError as e:
            raise ValueError(f"[eval] regression_set {path} line {raw.line}: {e.reason}: {e.detail}") from e
        if len(out) >= limit:
            break
    return out


def gate(losses: Losses, cfg: EvalConfig,
         metrics: dict[str, dict[str, float] | None] | None = None) -> GateResult:
    """Promote only if every rule passes. `metrics` maps "<data>_<before|after>" to
    {"loss", "accuracy", "perplexity"}; without it, the losses alone ("<data>_<before|after>")
    are used. A rule whose data is missing is skipped (recorded as such) unless `required`."""
    checks = []
    for rule in cfg.rules():
        before, after = (_value(rule, when, losses, metrics) for when in ("before", "after"))
        if before is None or after is None:
            checks.append(GateCheck(name=rule.name, before=before, after=after, change=None, change_pct=None,
                                    rule=rule.describe(), passed=not rule.required,
                                    skipped=f"no {rule.data} {rule.metric} measured"))
            continue
        checks.append(_check(rule, before, after))
    return GateResult(passed=all(c.passed for c in checks), checks=checks)


def _value(rule: GateRule, when: str, losses: Losses,
           metrics: dict[str, dict[str, float] | None] | None) -> float | None:
    key = f"{rule.data}_{when}"
    measured = (metrics or {}).get(key)
    if measured:
        return measured.get(rule.metric)
    loss = getattr(losses, key, None)
    if loss is None or rule.metric == "accuracy":
        return None
    return loss if rule.metric == "loss" else math.exp(min(loss, 700.0))


def _check(rule: GateRule, before: float, after: float) -> GateCheck:
    worse = (before - after) if rule.metric in HIGHER_IS_BETTER else (after - before)  # > 0: got worse
    ok = True
    if rule.max_worse_pct is not None:
        ok &= worse <= abs(before) * rule.max_worse_pct / 100
    if rule.max_worse is not None:
        ok &= worse <= rule.max_worse
    if rule.limit is not None:
        ok &= after >= rule.limit if rule.metric in HIGHER_IS_BETTER else after <= rule.limit
    change_pct = (after - before) / abs(before) * 100 if before else None
    return GateCheck(name=rule.name, before=before, after=after, change=after - before, change_pct=change_pct,
                     rule=rule.describe(), passed=bool(ok))
