"""The contract between the night's parts: what crosses the child's pipe, what a run leaves behind,
and what `nightshift calibrate` hands the night.

Why one package: the daemon (no torch) and the night's child (torch) are two processes that only
share this; every value that crosses is a typed model, validated where it is read, so a string
like "off" can never become `True` on the way (it once switched checkpointing on behind the
planner's back). Pydantic only: importable by the daemon without the training stack.
"""

from __future__ import annotations

from jobs.contract.basics import (
    ExitCode,
    Frozen,
    Method,
    Outcome,
    Phase,
    QuarantineReason,
    new_run_id,
    nightshift_version,
    outcome_exit_code,
    parse_version_name,
    version_name,
)
from jobs.contract.calibration import (
    CalibrationRecord,
    FP8Numerics,
    LayerNumerics,
    MemoryModel,
    Plan,
    ShapeRate,
    StepShape,
)
from jobs.contract.events import (
    ChildEvent,
    Emit,
    GpuCardReading,
    GpuEvent,
    HotswapEvent,
    OomSplitEvent,
    PhaseEvent,
    PlanEvent,
    ProgressEvent,
    ResultEvent,
    SharesEvent,
    parse_event,
)
from jobs.contract.summary import (
    AdapterShare,
    EvalMetrics,
    ExpertLoraReport,
    FileCheck,
    GateCheck,
    GateResult,
    GpuSummary,
    HotswapOutcome,
    Losses,
    RecordProblem,
    RunSummary,
)

__all__ = [
    "AdapterShare",
    "CalibrationRecord",
    "ChildEvent",
    "Emit",
    "EvalMetrics",
    "ExitCode",
    "ExpertLoraReport",
    "FP8Numerics",
    "FileCheck",
    "Frozen",
    "GateCheck",
    "GateResult",
    "GpuCardReading",
    "GpuEvent",
    "GpuSummary",
    "HotswapEvent",
    "HotswapOutcome",
    "LayerNumerics",
    "Losses",
    "MemoryModel",
    "Method",
    "OomSplitEvent",
    "Outcome",
    "Phase",
    "PhaseEvent",
    "Plan",
    "PlanEvent",
    "ProgressEvent",
    "QuarantineReason",
    "RecordProblem",
    "ResultEvent",
    "RunSummary",
    "ShapeRate",
    "SharesEvent",
    "StepShape",
    "new_run_id",
    "nightshift_version",
    "outcome_exit_code",
    "parse_event",
    "parse_version_name",
    "version_name",
]
