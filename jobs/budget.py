"""Plan: how many pending samples fit in what is left of the window.

capacity (tokens) = (deadline - now - overheads) x tokens/s x safety / epochs, where
tokens/s and overheads (load + evaluate + publish) are the median of the last runs
measured for this exact (model, backend, device, training config) key. With no
history the configured conservative prior is used, and the plan says so.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.ledger import SampleRow


class PlanConfig(BaseModel):
    """[plan]"""

    model_config = ConfigDict(extra="forbid")
    order: Literal["oldest", "newest"] = "oldest"
    prior_tokens_per_second: float = Field(200.0, gt=0, description="used until a run or calibrate measures")
    prior_overhead_seconds: float = Field(600.0, ge=0, description="load + evaluate + publish, until measured")
    history_runs: int = Field(3, ge=1, description="median over this many recent measurements")
    safety_factor: float = Field(0.9, gt=0, le=1, description="plan for this share of the estimated capacity")
    max_samples: int | None = Field(None, ge=1)
    heldout_share: float = Field(0.05, ge=0, lt=1, description="share of new samples kept out for evaluation")


@dataclass
class Plan:
    key: str
    train_ids: list[int]
    heldout_ids: list[int]
    train_tokens: int
    deferred_samples: int
    deferred_tokens: int
    tokens_per_second: float
    overhead_seconds: float
    available_seconds: float
    predicted_train_seconds: float
    epochs: int
    basis: str  # where the figures come from, in words
    measured: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def throughput_key(parts: dict[str, Any]) -> str:
    """Stable key for 'the same work on the same machine': any change makes a new history."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_heldout(sample_hash: str, share: float) -> bool:
    """Deterministic by content, so a resumed run and a rerun split the same way."""
    return share > 0 and int(sample_hash[:8], 16) / 0xFFFFFFFF < share


def estimate(history: list[Any], cfg: PlanConfig) -> tuple[float, float, str, bool]:
    """tokens/s, overhead seconds, basis text, measured? from throughput history rows (newest first)."""
    rows = history[: cfg.history_runs]
    if not rows:
        return (cfg.prior_tokens_per_second, cfg.prior_overhead_seconds,
                f"prior from config ({cfg.prior_tokens_per_second:g} tok/s, "
                f"{cfg.prior_overhead_seconds:g} s overhead): nothing measured yet for this model/device/config",
                False)
    tps = statistics.median(float(r["tokens_per_second"]) for r in rows)
    overheads = [float(r["overhead_seconds"]) for r in rows if r["overhead_seconds"] is not None]
    overhead = statistics.median(overheads) if overheads else cfg.prior_overhead_seconds
    origins = sorted({str(r["origin"]) for r in rows})
    return tps, overhead, f"measured: median of {len(rows)} ({', '.join(origins)}): {tps:,.0f} tok/s", True


def make_plan(pending: list[SampleRow], *, now: float, deadline: float, history: list[Any], cfg: PlanConfig,
              epochs: int, key: str) -> Plan:
    tps, overhead, basis, measured = estimate(history, cfg)
    available = max(0.0, deadline - now - overhead)
    capacity = available * tps * cfg.safety_factor / max(1, epochs)  # real tokens we may plan
    train: list[int] = []
    heldout: list[int] = []
    tokens = 0
    cut = len(pending)
    for i, s in enumerate(pending):
        if cfg.max_samples is not None and len(train) >= cfg.max_samples:
            cut = i
            break
        if is_heldout(s.hash, cfg.heldout_share):
            heldout.append(s.id)
            continue
        if tokens + s.n_tokens > capacity:
            cut = i
            break
        train.append(s.id)
        tokens += s.n_tokens
    rest = pending[cut:]
    return Plan(
        key=key, train_ids=train, heldout_ids=heldout, train_tokens=tokens,
        deferred_samples=len(rest), deferred_tokens=sum(s.n_tokens for s in rest),
        tokens_per_second=tps, overhead_seconds=overhead, available_seconds=available,
        predicted_train_seconds=tokens * max(1, epochs) / tps, epochs=max(1, epochs),
        basis=basis, measured=measured,
    )
