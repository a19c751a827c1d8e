"""Plan: how many pending samples fit in what is left of the window.

capacity (tokens) = (deadline - now - overheads) x tokens/s x safety / epochs, where
tokens/s and overheads (load + evaluate + publish) are the median of the last runs
measured for this exact (model, backend, device, training config) key. With no
history the configured conservative prior is used, and the plan says so.

Replay (against forgetting): `replay_share` of the night's training tokens are samples
already trained on earlier nights, mixed in with the new ones. New samples get
(1 - replay_share) of the capacity; replay tokens then top the night up to the share
(replay = new x share / (1 - share)), so a small night gets a small replay and the
total still fits the capacity. Replay is chosen by a hash of (seed, sample hash):
deterministic for a run, independent of the pool's order, and a sample's rank does not
change when the pool grows. A night with no new sample trains nothing (no replay-only nights).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.contract import Plan
from jobs.store.ledger import SampleRow


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
    # 0.1: one token in ten revisits earlier nights' data, a common rehearsal ratio for continual
    # fine-tuning; it costs 10% of the night's capacity. 0 turns replay off.
    replay_share: float = Field(0.1, ge=0, le=0.9, description="share of the night's training tokens "
                                "drawn from samples trained on earlier nights (against forgetting)")


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


def replay_rank(seed: str, sample_hash: str) -> str:
    return hashlib.sha256(f"{seed}:{sample_hash}".encode()).hexdigest()


def choose_replay(pool: Sequence[SampleRow], budget_tokens: float, seed: str) -> list[SampleRow]:
    """Samples of the pool in seeded-hash order, each taken if it still fits the budget."""
    out: list[SampleRow] = []
    tokens = 0
    for s in sorted(pool, key=lambda s: replay_rank(seed, s.hash)):
        if tokens + s.n_tokens <= budget_tokens:
            out.append(s)
            tokens += s.n_tokens
        if budget_tokens - tokens < 1:
            break
    return sorted(out, key=lambda s: s.id)


def make_plan(pending: list[SampleRow], *, now: float, deadline: float, history: list[Any], cfg: PlanConfig,
              epochs: int, key: str, replay_pool: Sequence[SampleRow] = (), seed: str = "") -> Plan:
    """`replay_pool`: samples trained on earlier nights (ledger.replay_pool()); `seed`: the run."""
    tps, overhead, basis, measured = estimate(history, cfg)
    available = max(0.0, deadline - now - overhead)
    total_capacity = available * tps * cfg.safety_factor / max(1, epochs)  # real tokens we may plan
    share = cfg.replay_share if replay_pool else 0.0
    capacity = total_capacity * (1 - share)  # what the new samples may take
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
    replay_budget = min(tokens * share / (1 - share), total_capacity - tokens) if train and share else 0.0
    replay = choose_replay(replay_pool, replay_budget, seed) if replay_budget >= 1 else []
    replay_tokens = sum(s.n_tokens for s in replay)
    total = tokens + replay_tokens
    return Plan(
        key=key, train_ids=train, heldout_ids=heldout, train_tokens=total,
        deferred_samples=len(rest), deferred_tokens=sum(s.n_tokens for s in rest),
        tokens_per_second=tps, overhead_seconds=overhead, available_seconds=available,
        predicted_train_seconds=total * max(1, epochs) / tps, epochs=max(1, epochs),
        basis=basis, measured=measured, replay_ids=[s.id for s in replay], replay_tokens=replay_tokens,
    )
