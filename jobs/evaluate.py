"""Evaluate: token-weighted loss on held-out new samples and on a fixed regression set,
for the adapter in service (or the bare base) and for the candidate; then the gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jobs.batching import IGNORE_INDEX, TokenizedSample, padded_batches
from jobs.formats import RecordError, normalise
from jobs.render import tokenize_record
from jobs.sources import read_records


class EvalConfig(BaseModel):
    """[eval]"""

    model_config = ConfigDict(extra="forbid")
    regression_set: Path | None = None  # a JSONL/JSON/CSV/Parquet file of records that must not get worse
    max_regression_increase_pct: float = Field(2.0, ge=0, description="regression loss may rise at most this")
    max_heldout_increase_pct: float | None = Field(
        None, ge=0, description="held-out loss may rise at most this (None: not gated)")
    max_eval_samples: int = Field(512, ge=1, description="cap per set, to bound evaluation time")
    max_tokens_per_batch: int = Field(8192, ge=16)


@dataclass(frozen=True)
class GateCheck:
    metric: str
    before: float
    after: float
    limit_pct: float
    passed: bool


def eval_loss(model: Any, samples: Sequence[TokenizedSample], *, pad_id: int, device: str,
              max_tokens_per_batch: int) -> float | None:
    """Mean loss per trained-on token (the same weighting as training)."""
    import torch

    from jobs.train import to_device

    if not samples:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in padded_batches(samples, batch_size=64, max_tokens_per_batch=max_tokens_per_batch, pad_id=pad_id):
            n = sum(1 for row in b.labels for x in row[1:] if x != IGNORE_INDEX)  # HF shifts labels by one
            if n == 0:
                continue
            out = model(**to_device(b, device))
            total += float(out.loss) * n
            count += n
    if was_training:
        model.train()
    return total / count if count else None


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


def gate(losses: dict[str, float | None], cfg: EvalConfig) -> tuple[bool, list[GateCheck]]:
    """Promote only if no gated loss rose by more than its limit. No data for a metric: not gated."""
    checks = []
    for metric, limit in (("regression", cfg.max_regression_increase_pct),
                          ("heldout", cfg.max_heldout_increase_pct)):
        before, after = losses.get(f"{metric}_before"), losses.get(f"{metric}_after")
        if limit is None or before is None or after is None:
            continue
        checks.append(GateCheck(metric, before, after, limit, after <= before * (1 + limit / 100)))
    return all(c.passed for c in checks), checks
