"""The child's events: JSON lines on its stdout, validated where they are read."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from jobs.contract.basics import Phase
from jobs.contract.calibration import Plan
from jobs.contract.summary import AdapterShare, HotswapOutcome, RunSummary

# ---- the child's events (JSON lines on its stdout) -------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ts: float = Field(default_factory=time.time)
    adapter: str = ""  # whose step this is ([[adapters]]); "" in a config of one adapter


class PhaseEvent(_Event):
    event: Literal["phase"] = "phase"
    phase: Phase
    state: Literal["start", "end"]
    seconds: float | None = None


class PlanEvent(_Event):
    event: Literal["plan"] = "plan"
    plan: Plan


class ProgressEvent(_Event):
    event: Literal["progress"] = "progress"
    version: int | None = None
    fraction: float = Field(ge=0, le=1)
    tokens: int = 0
    planned_tokens: int | None = None
    steps: int = 0
    samples: int = 0
    tokens_per_second: float = 0.0
    eta: float | None = None  # unix seconds the training should end
    loss: float | None = None


class GpuCardReading(BaseModel):
    """One card's reading, where a night uses several (the `gpu` label of the per-card series)."""

    model_config = ConfigDict(extra="forbid")
    gpu: str  # the card's index as CUDA_VISIBLE_DEVICES / `[train] devices` name it
    power_watts: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None


class GpuEvent(_Event):
    """The cards a night uses, summed (power, energy, memory), averaged (utilisation) or their maximum
    (temperature); `cards`: each card's own reading where there are several."""

    event: Literal["gpu"] = "gpu"
    power_watts: float | None = None
    energy_joules_total: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    utilization_ratio: float | None = None
    temperature_celsius: float | None = None
    cards: list[GpuCardReading] = Field(default_factory=list)


class HotswapEvent(_Event):
    event: Literal["hotswap"] = "hotswap"
    version: int
    outcome: HotswapOutcome


class OomSplitEvent(_Event):
    event: Literal["oom_split"] = "oom_split"
    tokens: int
    halves: list[int]


class SharesEvent(_Event):
    """[[adapters]]: the plan over adapters (each one's slice of the window), before anything trains."""

    event: Literal["shares"] = "shares"
    shares: list[AdapterShare]


class ResultEvent(_Event):
    event: Literal["result"] = "result"
    summary: RunSummary


ChildEvent = Annotated[
    PhaseEvent | PlanEvent | ProgressEvent | GpuEvent | HotswapEvent | OomSplitEvent | SharesEvent
    | ResultEvent,
    Field(discriminator="event"),
]
_EVENTS: TypeAdapter[ChildEvent] = TypeAdapter(ChildEvent)
Emit = Callable[[ChildEvent], None]  # how the child's parts report (the child writes each as a JSON line)


def parse_event(raw: str | bytes | dict[str, Any]) -> ChildEvent:
    """One event from the pipe (a JSON line) or a dict; raises ValueError naming what is wrong."""
    try:
        if isinstance(raw, dict):
            return _EVENTS.validate_python(raw)
        return _EVENTS.validate_json(raw)
    except ValidationError as e:
        raise ValueError(f"not a child event: {e.errors()[0].get('msg')} at {e.errors()[0].get('loc')}") from None
