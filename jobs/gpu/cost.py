"""What a night's tokens cost: joules and dollars per million trained tokens, derived from what a RunSummary
already holds (the card's energy in GpuSummary, trained_tokens, the run's start and end, its cards) and the
operator's `[gpu] price_per_gpu_hour`. Nothing here is stored: the CLI summary, `adapters show`, the report and
the metrics all derive it through token_cost, so the figures cannot disagree.

Dollars count the card for the whole night (child start to end, times the cards that trained it: load,
evaluation and publication hold the card too), at the configured price; no price, no dollars. On one H200
(RESULTS.md: 2026-11-28, 8B FP8 night) the default 8B night used 31.1 J per 1k tokens, 1.71 M tokens in 114 s.
For scale: Tinker lists $0.44 per million training tokens for Qwen3-8B (ANCHORS.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from jobs.contract import RunSummary

MILLION = 1_000_000


class TokenCost(BaseModel):
    """Per million trained tokens; None where the night does not say (no card, no tokens, no price)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: int
    joules_per_million_tokens: float | None = None
    gpu_hours: float | None = None  # the card(s) held by the night: wall hours x cards
    price_per_gpu_hour: float | None = None
    dollars_per_million_tokens: float | None = None

    @property
    def joules_per_1k_tokens(self) -> float | None:
        return None if self.joules_per_million_tokens is None else self.joules_per_million_tokens / 1000

    def line(self) -> str | None:
        """One line for the terminal ("31.1 kJ per million tokens, $0.065 per million tokens at $3.50 per
        GPU-hour (0.032 GPU-hours)"), or None when there is nothing to say. (kJ per million = J per 1k.)"""
        parts = []
        if self.joules_per_million_tokens is not None:
            parts.append(f"{self.joules_per_million_tokens / 1000:,.1f} kJ per million tokens")
        if self.dollars_per_million_tokens is not None:
            parts.append(f"${self.dollars_per_million_tokens:,.3f} per million tokens at "
                         f"${self.price_per_gpu_hour:,.2f} per GPU-hour ({self.gpu_hours:,.3f} GPU-hours)")
        return ", ".join(parts) or None


def token_cost(*, tokens: int, energy_joules: float | None, seconds: float | None, cards: int = 1,
               price_per_gpu_hour: float | None = None) -> TokenCost:
    """The night's cost per million trained tokens from its energy, its wall `seconds` and `cards`."""
    per_m = MILLION / tokens if tokens > 0 else None
    joules = energy_joules * per_m if per_m and energy_joules and energy_joules > 0 else None
    hours = seconds * max(1, cards) / 3600 if seconds is not None and seconds > 0 else None
    dollars = price_per_gpu_hour * hours * per_m if per_m and hours and price_per_gpu_hour else None
    return TokenCost(tokens=max(0, tokens), joules_per_million_tokens=joules, gpu_hours=hours,
                     price_per_gpu_hour=price_per_gpu_hour, dollars_per_million_tokens=dollars)


def summary_cost(s: RunSummary, price_per_gpu_hour: float | None = None) -> TokenCost:
    """token_cost of a RunSummary (the child's last event, the ledger's `runs.summary`)."""
    seconds = s.ended_at - s.started_at if s.started_at is not None and s.ended_at is not None else None
    return token_cost(tokens=s.trained_tokens, energy_joules=s.gpu.energy_joules if s.gpu else None,
                      seconds=seconds, cards=s.ranks, price_per_gpu_hour=price_per_gpu_hour)
