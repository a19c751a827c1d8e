"""The plan over adapters: each adapter's slice of the window, before anything trains.

Water-filling: an adapter's slice is its overhead plus `level x weight` of the training time, kept between its
floor (`min_share` of the window, never more than it can use) and its demand (its pending tokens at its
measured rate); the
level is the one at which the slices fill the window (where every demand is met, the spare is shared by
weight: a margin for an estimate that was short).
The adapters then run in turn, each until the sum of the slices so far: time one leaves unused passes on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jobs.contract import AdapterShare


def water_fill(window: float, shares: Sequence[AdapterShare]) -> list[AdapterShare]:
    """Each share's `seconds` and `share` of `window` (seconds), from weight, min_share and demand. The overheads
    (load, evaluate, publish) of the adapters with something to train come off the window first: a slice
    shorter than its adapter's overhead would train nothing at all."""
    total = max(0.0, window)
    busy = [s.overhead_seconds if s.demand_seconds is None or s.demand_seconds > 0 else 0.0 for s in shares]
    window = max(0.0, total - sum(busy))
    demand = [math.inf if s.demand_seconds is None else max(0.0, s.demand_seconds) for s in shares]
    floor = [min(s.min_share * window, d) for s, d in zip(shares, demand, strict=True)]
    if sum(floor) > window > 0:  # floors that overflow (min_share adds up to <= 1, but the window rounds)
        floor = [f * window / sum(floor) for f in floor]

    def filled(level: float) -> list[float]:
        return [min(d, max(f, level * s.weight)) for s, f, d in zip(shares, floor, demand, strict=True)]

    if all(d < math.inf for d in demand) and sum(demand) <= window:
        # everything fits: each gets what it needs, and the spare by weight (a margin, never unused on purpose)
        spare, weights = window - sum(demand), sum(s.weight for s in shares)
        seconds = [d + spare * s.weight / weights for s, d in zip(shares, demand, strict=True)]
    else:
        lo, hi = 0.0, window / min(s.weight for s in shares) if shares else 0.0
        for _ in range(100):  # bisection on the level: the sum is monotone in it
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(filled(mid)) < window else (lo, mid)
        seconds = filled(hi)
    seconds = [sec + b for sec, b in zip(seconds, busy, strict=True)]
    return [s.model_copy(update={"seconds": sec, "share": sec / total if total > 0 else 0.0})
            for s, sec in zip(shares, seconds, strict=True)]


def slice_ends(start: float, deadline: float, shares: Sequence[AdapterShare]) -> list[float]:
    """Each adapter's deadline when they run in this order from `start`: the sum of the slices so far
    (what an earlier one leaves unused passes to the next), the last one the window's own deadline."""
    ends, t = [], start
    for i, s in enumerate(shares):
        t += s.seconds
        ends.append(deadline if i == len(shares) - 1 else min(deadline, t))
    return ends
