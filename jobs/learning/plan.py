"""Plan: how many pending samples fit in what is left of the window.

capacity (tokens) = (deadline - now - overheads) x tokens/s x safety / epochs, where
tokens/s and overheads (load + evaluate + publish) are the median of the last runs
measured for this exact (model, backend, device, training config) key. With no
history the configured conservative prior is used, and the plan says so.

Replay (against forgetting): `replay_share` of the night's training tokens are samples
already trained on earlier nights, mixed in with the new ones. New samples get
(1 - replay_share) of the capacity, or all that the replay pool cannot fill when it holds fewer
tokens than its share (a second night after a short first one); replay tokens then top the night up
to the share (replay = new x share / (1 - share)), so a small night gets a small replay and the
total still fits the capacity. The choice is stratified by night and source, with a minimum
per stratum, and seeded by the night (jobs/learning/replay.py). A night with no new sample trains
nothing (no replay-only nights).

Held-out samples (kept out of training to measure each version on unseen data) are chosen by
content hash among *all* pending samples, deferred ones included: with no backlog every such
sample is held out tonight; under a backlog tonight takes its share of them (the share of the
trainable backlog it trains, at least `min_heldout`) and leaves the rest for the nights that
train the rest of the backlog, so every night has held-out data.

When recent throughput measurements differ by more than 10 %, the plan uses a low quantile of
them (`throughput_quantile`) instead of the median, and says so in its basis. A measurement that timed
under a quarter of the longest recent one and under a minute (a killed night's few steps after its
restart) is left out first: its rate is the start-up's, not the card's. Nights measured since the newest
calibrate replace it: they timed the night's own data and loop for minutes, calibrate a few seconds of
synthetic samples (on an H200 it read 5-12 % below the nights that followed it, 4.6 % once its first
window waited out 30 s of steps; the rest is not explained). A rate is taken at the pending samples'
mean length: calibrate timed two length profiles, and a measurement is moved along that line from the
length it was measured at (`rate_at_length`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.contract import Plan
from jobs.learning.replay import choose_replay
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
    # 0.5: measured on the two-task chain (RESULTS.md: 2026-11-23, CPU chain of nights): 0.1 and 0.3 let a conflicting
    # second task take the first one down to 12-75 % exact match; 0.5 kept it >= 92 % and learned the
    # second as fast. It costs half of a night's capacity when there is a backlog. 0 turns replay off.
    replay_share: float = Field(0.5, ge=0, le=0.9, description="share of the night's training tokens "
                                "drawn from samples trained on earlier nights (against forgetting)")
    replay_min_per_stratum: int = Field(2, ge=0, description="replayed samples per earlier night and source "
                                        "at least (capacity allowing)")
    throughput_quantile: float = Field(0.2, ge=0, le=0.5, description="when recent throughputs vary by more "
                                       "than 10 %, plan with this quantile of them instead of the median")
    rejected_samples: Literal["pending", "rejected"] = Field(
        "pending", description="a rejected night's samples: back to pending (trained again), or to 'rejected' "
        "(kept, never trained nor replayed)")
    set_aside_after: int = Field(2, ge=1, description="a sample in this many rejected nights is set aside")


def throughput_key(parts: dict[str, Any]) -> str:
    """Stable key for 'the same work on the same machine': any change makes a new history."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_heldout(sample_hash: str, share: float) -> bool:
    """Deterministic by content, so a resumed run and a rerun split the same way."""
    return share > 0 and int(sample_hash[:8], 16) / 0xFFFFFFFF < share


VARY = 0.10  # recent throughputs that differ by more than this (of their median) are not trusted to the median
# A measurement that timed under this share of the longest recent one's seconds is left out of the estimate
# (the longest is always kept): a killed night's restart timed ~6 steps at 51k tok/s on the H100 where its
# nights ran at 72k, and the low quantile it caused over-predicted the next night by 22 %.
THIN = 0.25
TRUSTED_SECONDS = 60.0  # a measurement of at least this long is never left out (a short night is still a night)


def _timed_seconds(row: Any) -> float | None:
    try:
        v = row["seconds"]
    except (KeyError, IndexError):
        return None
    return float(v) if isinstance(v, int | float) else None


def _is_calibrate(row: Any) -> bool:
    return str(row["origin"]).startswith("calibrate")  # "calibrate scaled x0.93" too (jobs.training.shape)


def substantial(rows: list[Any]) -> tuple[list[Any], list[float]]:
    """The rows that timed at least THIN of the longest row's seconds (or TRUSTED_SECONDS), and the seconds
    of those left out. Rows that recorded no seconds are kept (nothing to judge them by), and calibrate's
    (a short window, but timed after its warm-up and without its stalls)."""
    timed = [None if _is_calibrate(r) else _timed_seconds(r) for r in rows]
    floor = min(THIN * max((t for t in timed if t is not None), default=0.0), TRUSTED_SECONDS)
    keep = [r for r, t in zip(rows, timed, strict=True) if t is None or t >= floor]
    return keep, [t for t in timed if t is not None and t < floor]


def since_calibrate(rows: list[Any]) -> tuple[list[Any], int]:
    """The rows without calibrate's when a night measured after the newest calibrate (newest first), and how
    many were left out."""
    first = next((i for i, r in enumerate(rows) if _is_calibrate(r)), None)
    if not first:  # no calibrate, or it is the newest measurement
        return rows, 0
    keep = [r for r in rows if not _is_calibrate(r)]
    return keep, len(rows) - len(keep)


def rate_at_length(curve: Mapping[float, float], mean_tokens: float) -> float:
    """tokens/s for samples averaging `mean_tokens`, log-linear between the timed profiles' mean lengths
    (`curve`: mean tokens -> tokens/s), the nearest profile's outside them."""
    pts = sorted(curve.items())
    if mean_tokens <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if mean_tokens <= x1:
            w = math.log(mean_tokens / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def _measured_length(row: Any) -> float | None:
    d = _details([row])
    v = d[0].get("mean_sample_tokens") if d else None
    return float(v) if _number(v) and v > 0 else None


def at_length(rows: list[Any], curve: Mapping[float, float] | None, mean_tokens: float | None) -> list[Any]:
    """Each row's rate moved along calibrate's length line to `mean_tokens`: calibrate's row holds its slower
    profile, a night's the mean length it trained (older rows that do not say stay as they are)."""
    if not curve or not mean_tokens or min(curve.values()) <= 0:
        return rows
    to, slowest = rate_at_length(curve, mean_tokens), min(curve.values())
    out = []
    for r in rows:
        if _is_calibrate(r):
            frm: float | None = slowest
        else:
            length = _measured_length(r)
            frm = rate_at_length(curve, length) if length is not None else None
        factor = to / frm if frm else 1.0
        d = {k: r[k] for k in r.keys()}  # noqa: SIM118  (sqlite3.Row has no items())
        d["tokens_per_second"] = float(r["tokens_per_second"]) * factor
        out.append(d)
    return out


def estimate(history: list[Any], cfg: PlanConfig, *, curve: Mapping[float, float] | None = None,
             mean_tokens: float | None = None) -> tuple[float, float, str, bool]:
    """tokens/s, overhead seconds, basis text, measured? from throughput history rows (newest first);
    `curve` (calibrate's mean tokens -> tokens/s) and `mean_tokens` (tonight's samples) take each rate to
    tonight's length."""
    rows, thin = substantial(history[: cfg.history_runs])
    rows, superseded = since_calibrate(rows)
    if not rows:
        return (cfg.prior_tokens_per_second, cfg.prior_overhead_seconds,
                f"prior from config ({cfg.prior_tokens_per_second:g} tok/s, "
                f"{cfg.prior_overhead_seconds:g} s overhead): nothing measured yet for this model/device/config",
                False)
    rows = at_length(rows, curve, mean_tokens)
    values = sorted(float(r["tokens_per_second"]) for r in rows)
    tps = statistics.median(values)
    overheads = [float(r["overhead_seconds"]) for r in rows if r["overhead_seconds"] is not None]
    overhead = statistics.median(overheads) if overheads else cfg.prior_overhead_seconds
    origins = ", ".join(sorted({str(r["origin"]) for r in rows}))
    notes = (f"; left out {len(thin)} that timed {', '.join(f'{t:.1f}' for t in thin)} s, under "
             f"{THIN:.0%} of the longest") if thin else ""
    notes += "; calibrate left out: nights measured since" if superseded else ""
    notes += (f"; at {mean_tokens:,.0f} tokens a sample (calibrate's length line)"
              if curve and mean_tokens else "")
    spread = (values[-1] - values[0]) / tps if tps > 0 else 0.0
    if len(values) > 1 and spread > VARY:
        median, tps = tps, quantile(values, cfg.throughput_quantile)
        return tps, overhead, (f"measured: {len(rows)} ({origins}) vary by {spread:.0%}: their "
                               f"{cfg.throughput_quantile:.0%} quantile {tps:,.0f} tok/s (median {median:,.0f})"
                               f"{notes}"), True
    return tps, overhead, f"measured: median of {len(rows)} ({origins}): {tps:,.0f} tok/s{notes}", True


def _details(rows: list[Any]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        try:
            d = json.loads(r["detail"] or "{}")
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v >= 0


def expected_warmup(details: list[dict[str, Any]]) -> float:
    """Median seconds of the runs' warm-up steps (a compile, the probes): the rate leaves them out and
    the overhead holds them, so the predicted training time adds them back. 0 before any run."""
    seen = [float(d["warmup_seconds"]) for d in details if _number(d.get("warmup_seconds"))]
    return statistics.median(seen) if seen else 0.0


def seconds_per_checkpoint(details: list[dict[str, Any]]) -> float:
    """Median seconds one periodic checkpoint save took in the runs that saved one: the rate leaves the
    saves out, so the predicted training time adds one per `checkpoint_every_seconds`. 0 before any."""
    seen = [d["checkpoint_seconds"] / d["checkpoints"] for d in details
            if _number(d.get("checkpoint_seconds")) and _number(d.get("checkpoints")) and d["checkpoints"] > 0]
    return statistics.median(seen) if seen else 0.0


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def make_plan(pending: list[SampleRow], *, now: float, deadline: float, history: list[Any], cfg: PlanConfig,
              epochs: int, key: str, replay_pool: Sequence[SampleRow] = (), seed: str = "",
              min_heldout: int = 0, checkpoint_every_seconds: float | None = None,
              curve: Mapping[float, float] | None = None) -> Plan:
    """`replay_pool`: samples trained on earlier nights (jobs.store.learning.replay_pool); `seed`: the
    night; `min_heldout`: held-out samples a night under a backlog takes at least (when there are);
    `checkpoint_every_seconds`: the training's save interval (its saves are added to the predicted time);
    `curve`: calibrate's mean tokens a sample -> tokens/s (the rate is taken at the pending samples' length)."""
    candidates = [s for s in pending if is_heldout(s.hash, cfg.heldout_share)]
    trainable = [s for s in pending if not is_heldout(s.hash, cfg.heldout_share)]
    mean_tokens = sum(s.n_tokens for s in trainable) / len(trainable) if trainable else None
    tps, overhead, basis, measured = estimate(history, cfg, curve=curve, mean_tokens=mean_tokens)
    details = _details(history[: cfg.history_runs])  # the recent runs' detail, parsed once
    warmup = expected_warmup(details)
    every = checkpoint_every_seconds or 0.0
    per_save = seconds_per_checkpoint(details) if every > 0 else 0.0
    available = max(0.0, deadline - now - overhead)
    saving = every / (every + per_save) if per_save else 1.0  # the share of training time not spent saving
    total_capacity = available * tps * saving * cfg.safety_factor / max(1, epochs)  # real tokens we may plan
    share = cfg.replay_share if replay_pool else 0.0
    # what the new samples may take: all but the replay's share, or all but the pool when it holds less
    capacity = total_capacity - min(total_capacity * share, sum(s.n_tokens for s in replay_pool))
    train: list[int] = []
    tokens = 0
    cut = len(trainable)
    for i, s in enumerate(trainable):
        if (cfg.max_samples is not None and len(train) >= cfg.max_samples) or tokens + s.n_tokens > capacity:
            cut = i
            break
        train.append(s.id)
        tokens += s.n_tokens
    rest = trainable[cut:]
    if rest:  # a backlog: tonight's share of the held-out candidates, the others wait for their nights
        k = max(min_heldout, math.ceil(len(candidates) * len(train) / len(trainable))) if train else 0
        heldout, rest = candidates[:k], rest + candidates[k:]
    else:
        heldout = candidates
    replay_budget = min(tokens * share / (1 - share), total_capacity - tokens) if train and share else 0.0
    replay = (choose_replay(replay_pool, replay_budget, seed, min_per_stratum=cfg.replay_min_per_stratum,
                            quota_cap=min(tokens, total_capacity - tokens))  # a quota never outweighs the new
              if replay_budget >= 1 else [])
    replay_tokens = sum(s.n_tokens for s in replay)
    total = tokens + replay_tokens
    train_seconds = total * max(1, epochs) / tps + (warmup if total else 0.0)
    if per_save:
        train_seconds += math.floor(train_seconds / every) * per_save
    return Plan(
        key=key, train_ids=train, heldout_ids=[s.id for s in heldout], train_tokens=total,
        deferred_samples=len(rest), deferred_tokens=sum(s.n_tokens for s in rest),
        tokens_per_second=tps, overhead_seconds=overhead, available_seconds=available,
        predicted_train_seconds=train_seconds, epochs=max(1, epochs),
        basis=basis, measured=measured, replay_ids=[s.id for s in replay], replay_tokens=replay_tokens,
    )



def resumed_plan(stored: Plan, *, left: float, done_tokens: int) -> tuple[Plan, int]:
    """A resumed night's plan for this attempt, and the tokens the night now plans in all: the samples planned at
    its first start (the checkpoint's batch order needs them; `train_tokens` stays theirs), the tokens trained
    before, and the time left now (a new `--until`). What will not fit at the plan's rate is shown deferred, as the
    loop cuts it (whole samples, the last of the order); the predicted seconds are this attempt's."""
    tps = max(stored.tokens_per_second, 1e-9)
    total = stored.train_tokens * stored.epochs
    rest = max(0, total - done_tokens)
    fits = min(float(rest), left * tps)
    cut = 1.0 - (done_tokens + fits) / total if total and fits < rest else 0.0
    deferred = min(len(stored.train_ids), math.ceil(len(stored.train_ids) * cut))
    plan = stored.model_copy(update={
        "available_seconds": left, "predicted_train_seconds": fits / tps,
        "deferred_samples": stored.deferred_samples + deferred,
        "deferred_tokens": stored.deferred_tokens + math.ceil(stored.train_tokens * cut),
        "basis": f"{stored.basis}; resumed with {left:,.0f} s left: the samples planned at the night's first start, "
                 f"{done_tokens:,} tokens trained before" + (f", ~{deferred:,} of them will not fit" if deferred
                                                               else "")})
    return plan, done_tokens + math.floor(fits)
