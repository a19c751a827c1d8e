"""[[adapters]] at the terminal: the plan that shares the window, and one row per adapter's night."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.tables import grid
from jobs.contract import AdapterShare, RunSummary


def shares_table(shares: Sequence[AdapterShare]) -> str:
    """Each adapter's pending tokens, measured rate, weight, floor and its slice of the window."""
    def num(x: float | None, fmt: str = ",.0f") -> str:
        return "—" if x is None else format(x, fmt)

    return grid(["adapter", "pending tokens", "tok/s", "weight", "min share", "needs s", "slice s", "share"],
                [[s.adapter, num(s.pending_tokens), num(s.tokens_per_second), f"{s.weight:g}", f"{s.min_share:.0%}",
                  num(s.demand_seconds, ",.1f"), num(s.seconds, ",.1f"), f"{s.share:.0%}"] for s in shares],
                max_width=120)


def adapters_table(results: Sequence[RunSummary]) -> str:
    """One row per adapter: how its night ended, its version, and why where it did not succeed."""
    rows = []
    for r in results:
        version = r.version_name or "—"
        if r.version_name and r.outcome.value in ("succeeded", "rejected"):
            version += " (promoted)" if r.promoted else " (kept, not promoted)"
        rows.append([r.adapter, r.outcome.value, version, f"{r.trained_samples:,}", f"{r.trained_tokens:,}",
                     "—" if r.actual_train_seconds is None else f"{r.actual_train_seconds:,.1f}",
                     (r.error or "")[:60]])
    return grid(["adapter", "outcome", "version", "samples", "tokens", "train s", "why"], rows, max_width=140)
