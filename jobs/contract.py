"""The contract between the night's parts: what crosses the child's pipe, what a run leaves behind,
and what `nightshift calibrate` hands the night.

Why one module: the daemon (no torch) and the night's child (torch) are two processes that only
share this; every value that crosses is a typed model, validated where it is read, so a string
like "off" can never become `True` on the way (it once switched checkpointing on behind the
planner's back). Pydantic only: importable by the daemon without the training stack.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from enum import IntEnum, StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class Outcome(StrEnum):
    """How a run ended (a metric label: keep the set small)."""

    succeeded = "succeeded"
    failed = "failed"
    skipped = "skipped"
    rejected = "rejected"
    interrupted = "interrupted"


class QuarantineReason(StrEnum):
    """Why a record (or a whole file) was quarantined (a metric label: keep the set small)."""

    invalid_json = "invalid_json"
    invalid_utf8 = "invalid_utf8"
    bad_file = "bad_file"
    missing_field = "missing_field"
    empty_field = "empty_field"
    wrong_type = "wrong_type"
    too_long = "too_long"  # more tokens than max_seq_length
    too_large = "too_large"  # over the bytes read per record, nested too deep, a number too long to parse
    bad_row = "bad_row"  # a CSV row whose fields do not match the header (or that the CSV reader rejects)
    special_tokens = "special_tokens"  # control-token text in content ([train] special_tokens = "reject")
    outside_inbox = "outside_inbox"  # a symbolic link out of the inbox (not followed, not read)
    unreadable = "unreadable"  # the file vanished, changed while read, or cannot be opened; retried next pull
    internal_error = "internal_error"  # an unexpected error on this record or file: kept, the night goes on


class Method(StrEnum):
    """How a night trains (`[train] method`; a metric label and part of every manifest)."""

    qlora = "qlora"  # 4-bit base, LoRA on top: a version is a LoRA adapter
    lora = "lora"  # 16-bit base, LoRA on top: a version is a LoRA adapter
    full = "full"  # every weight trained: a version is a whole model directory

    @property
    def is_adapter(self) -> bool:
        return self is not Method.full


class Phase(StrEnum):
    pull = "pull"
    plan = "plan"
    load = "load"
    train = "train"
    evaluate = "evaluate"
    publish = "publish"
    hotswap = "hotswap"


class ExitCode(IntEnum):
    """Exit statuses of every `nightshift` command and of the night's child."""

    OK = 0
    FAILED = 1  # the night or the command failed: the log says why
    USAGE = 2  # bad command line or bad config: every problem is printed
    INTERRUPTED = 3  # stopped on request; the checkpoint is saved and the next start resumes
    HOTSWAP_FAILED = 4  # published, but at least one inference server did not take it
    BUSY = 5  # another nightshift process holds the state directory



class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- what calibrate hands the night ---------------------------------------------------------------


class MemoryModel(Frozen):
    """peak bytes of a training step = static + per_token x real tokens in the step (measured)."""

    static_gb: float = Field(ge=0, description="weights, optimizer state, CUDA context (GB)")
    mb_per_token: float = Field(gt=0, description="activations per real token (MB)")

    def peak_gb(self, tokens: int) -> float:
        return self.static_gb + self.mb_per_token * tokens / 1000.0

    def tokens_fitting(self, limit_gb: float) -> int:
        return max(0, int((limit_gb - self.static_gb) * 1000.0 / self.mb_per_token))


class StepShape(Frozen):
    """How big a training step is and whether activations are recomputed: chosen once per run."""

    tokens_per_step: int = Field(ge=1)
    gradient_checkpointing: bool
    basis: str = Field(description="where the shape comes from, in words")
    free_vram_gb: float | None = Field(None, description="free card memory when the shape was chosen (NVML)")
    limit_gb: float | None = Field(None, description="what the step's predicted peak had to stay under")
    predicted_peak_gb: float | None = Field(None, description="the memory model's peak for this shape")
    compute: Literal["bf16", "fp8"] = Field("bf16", description="the frozen base's matmuls (issue 16)")


class ShapeRate(Frozen):
    """Training speed of one step shape on the slower length profile (calibrate times a few shapes)."""

    tokens_per_step: int = Field(ge=1)
    gradient_checkpointing: bool
    tokens_per_second: float = Field(gt=0)



class LayerNumerics(Frozen):
    """One frozen projection: relative output error ||y - y_ref|| / ||y_ref|| on captured activations."""

    name: str
    shape: tuple[int, int] = Field(description="(out_features, in_features)")
    fp8: float | None = Field(description="FP8 forward against the bf16 matmul with the weight as loaded")
    fp8_dgrad: float | None = Field(None, description="FP8 input gradient (s_w folded into dy) against bf16")
    nf4: float | None = Field(None, description="NF4 weight against the bf16 source weight (None: no source)")
    fp8_vs_source: float | None = Field(None, description="FP8 forward against the bf16 source weight")
    converted: bool = True
    fallback: str | None = Field(None, description="why it stays bf16")


class FP8Numerics(Frozen):
    """The FP8 numerics check of one model on one card: per-layer errors, the loss of a learnable task."""

    passed: bool
    reasons: list[str] = Field(default_factory=list, description="why it failed")
    activations: str = Field(description="where the activations came from")
    layers: int = 0
    converted: int = 0
    fallbacks: dict[str, int] = Field(default_factory=dict, description="reason -> projections kept in bf16")
    max_layer_error: float = Field(description="the per-layer limit")
    fp8_error: dict[str, float] = Field(default_factory=dict, description="median / p90 / max over layers")
    nf4_error: dict[str, float] = Field(default_factory=dict, description="median / p90 / max (bf16 source only)")
    by_projection: dict[str, dict[str, float]] = Field(default_factory=dict, description="q_proj -> fp8/nf4 medians")
    worst: list[LayerNumerics] = Field(default_factory=list)
    loss_bf16: list[float] = Field(default_factory=list)
    loss_fp8: list[float] = Field(default_factory=list)
    loss_max_rel_diff: float | None = Field(None, description="max over 5-step windows of |fp8 - bf16| / bf16")
    loss_tolerance: float | None = None
    loss_learned: bool | None = Field(None, description="the bf16 curve fell: the task was learnable")
    seconds: float = 0.0


class CalibrationRecord(Frozen):
    """One `nightshift calibrate` measurement of our training path on this GPU, model and config."""

    tokens_per_step: int = Field(ge=1)
    gradient_checkpointing: bool
    memory: MemoryModel
    tokens_per_second: dict[str, float] = Field(description="length profile -> real tokens per second")
    max_vram_gb: float = Field(gt=0, description="the cap the shape was chosen under")
    device: str
    versions: dict[str, str] = Field(default_factory=dict, description="library -> version measured with")
    overhead_seconds: float | None = Field(None, ge=0, description="load + evaluate + publish, if measured")
    overhead_detail: dict[str, float] = Field(default_factory=dict, description="load/evaluate/publish seconds")
    checkpointing_memory: MemoryModel | None = Field(
        None, description="the memory line with checkpointing on (when the main line is without)")
    checkpointing_measured: bool = Field(False, description="checkpointing_memory was probed, not estimated")
    rates: list[ShapeRate] = Field(default_factory=list, description="further shapes timed (smaller, ckpt)")
    measured_at: float = Field(default_factory=time.time)
    compute: Literal["bf16", "fp8"] = Field("bf16", description="what was measured: the frozen base in bf16 or FP8")
    fp8_refused: str | None = Field(None, description="why FP8 was refused on this card/model (compute auto)")
    numerics: FP8Numerics | None = Field(None, description="the FP8 numerics check, when it ran")

    @property
    def slowest_tokens_per_second(self) -> float:
        """A plan must not promise more than the worse length profile."""
        return min(self.tokens_per_second.values())

    def shape(self) -> StepShape:
        return StepShape(tokens_per_step=self.tokens_per_step, gradient_checkpointing=self.gradient_checkpointing,
                         basis=f"calibrated under max_vram_gb={self.max_vram_gb:g}", compute=self.compute)


# ---- the plan -----------------------------------------------------------------------------------


class Plan(BaseModel):
    """Tonight's plan: which samples train, which are held out, and the time it should take."""

    model_config = ConfigDict(extra="forbid")
    key: str
    train_ids: list[int]  # new samples, in training order
    heldout_ids: list[int]
    train_tokens: int  # every token trained once per epoch: new + replay
    deferred_samples: int
    deferred_tokens: int
    tokens_per_second: float
    overhead_seconds: float
    available_seconds: float
    predicted_train_seconds: float
    epochs: int
    basis: str  # where the figures come from, in words
    measured: bool
    replay_ids: list[int] = Field(default_factory=list)  # earlier nights' samples trained again
    replay_tokens: int = 0  # of train_tokens
    version: int | None = None
    parent_version: int | None = None
    backend: str | None = None
    device: str | None = None
    step_shape: StepShape | None = None  # the shape the throughput above is for

    def roles(self) -> list[tuple[int, str]]:
        """(sample id, role) in training order: replay spread evenly among the new samples, so an
        early stop still trained some of it and no batch is all old data; then held-out."""
        out: list[tuple[int, str]] = []
        n, r = len(self.train_ids), len(self.replay_ids)
        j = 0
        for i, sid in enumerate(self.train_ids):
            while j < r and (j + 1) * n <= (i + 1) * r:  # replay j goes after new sample j * n / r
                out.append((self.replay_ids[j], "replay"))
                j += 1
            out.append((sid, "train"))
        out += [(sid, "replay") for sid in self.replay_ids[j:]]
        return out + [(sid, "heldout") for sid in self.heldout_ids]


# ---- what a run leaves behind ---------------------------------------------------------------------


class GpuSummary(BaseModel):
    """The card's figures over a run (None where the card does not say)."""

    model_config = ConfigDict(extra="forbid")
    mean_power_watts: float | None = None
    energy_joules: float | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    total_memory_bytes: int | None = None
    name: str = ""


class Losses(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    train: float | None = None
    heldout_before: float | None = None
    heldout_after: float | None = None
    regression_before: float | None = None
    regression_after: float | None = None


class GateCheck(BaseModel):
    """One rule's numbers and verdict, as written to the manifest and the log."""

    model_config = ConfigDict(extra="forbid")
    name: str  # "<data>.<metric>", then " vs reference" / " vs base" when not against the adapter in service
    against: Literal["service", "reference", "base"] = "service"  # whose figures `before` holds
    before: float | None
    after: float | None
    change: float | None  # after - before (positive: the metric went up)
    change_pct: float | None
    rule: str
    passed: bool
    skipped: str | None = None  # why the rule had no data (then passed unless required)


class GateResult(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    passed: bool
    checks: list[GateCheck] = Field(default_factory=list)
    held_back: str | None = None  # passed, but not promoted (and why)
    reference_version: int | None = None  # the best promoted version so far (None: the base model)
    reference: str | None = None  # the anchor of the cumulative rules, in words
    new_reference: bool = False  # the candidate, promoted, became the reference

    def failed(self) -> str:
        """The failed checks in a line (why a night was rejected)."""
        return "; ".join(f"{c.name} {c.before:.4g} -> {c.after:.4g} ({c.rule})" if c.before is not None
                         and c.after is not None else f"{c.name}: {c.skipped}" for c in self.checks if not c.passed)


class HotswapOutcome(BaseModel):
    """One target's answer to one announcement (after its retries)."""

    model_config = ConfigDict(extra="forbid")
    target: str
    kind: str
    ok: bool
    attempts: int = 0
    seconds: float = 0.0
    error: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


# loss, perplexity (over trained tokens), token_accuracy (reply tokens), exact_match (whole replies), samples
EvalMetrics = dict[str, float]


class ExpertLoraReport(BaseModel):
    """Did the adapter train a mixture-of-experts base's experts? Counted every night (jobs/training/moe.py).

    A tensor is one LoRA factor (lora_A or lora_B) of an expert weight; a fused expert weight (PEFT
    `target_parameters`) holds every expert's factors in one tensor, so its experts are also counted
    one by one as slices. lora_A's gradient is zero by construction while its lora_B is still zero (a
    new adapter's first step): such a lora_A is judged on later passes, or counted as not judged."""

    model_config = ConfigDict(extra="forbid")
    tensors: int = Field(ge=0, description="expert LoRA tensors in the adapter")
    parameters: int = Field(0, ge=0, description="their parameters")
    with_grad: int = Field(0, ge=0, description="received a non-zero, finite gradient on the first passes")
    moved: int | None = Field(None, ge=0, description="differ from their value at load at the end (None: not checked)")
    not_judged: int = Field(0, ge=0, description="lora_A whose lora_B stayed zero on every watched pass")
    nonfinite: int = Field(0, ge=0, description="got a NaN or infinite gradient")
    grad_passes: int = Field(0, ge=0, description="forward/backward passes watched for gradients")
    expert_slices: int = Field(0, ge=0, description="(tensor, expert) slices of fused expert LoRA tensors")
    slices_with_grad: int = Field(0, ge=0)
    slices_moved: int | None = Field(None, ge=0)
    problems: list[str] = Field(default_factory=list, description="what failed, tensor names included")


class RunSummary(BaseModel):
    """Everything a night's run reports: the child's last event, the ledger's `runs.summary`, the
    source of the CLI's table and of the last-run metrics."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    run_id: str = ""
    night: str = ""
    outcome: Outcome = Outcome.failed
    error: str | None = None
    version: int | None = None
    version_name: str | None = None
    promoted: bool = False
    parent_version: int | None = None
    adapter_path: str | None = None
    base_model: str = ""
    method: Method | None = None  # how the version was (or is being) trained
    # data
    files_ingested: int = 0
    ingested: dict[str, int] = Field(default_factory=dict)  # source -> new samples
    duplicates: int = 0
    quarantined: dict[str, int] = Field(default_factory=dict)  # reason -> records
    # plan and training
    plan: Plan | None = None
    plan_basis: str | None = None
    trained_samples: int = 0
    trained_tokens: int = 0
    planned_tokens: int | None = None  # what the plan meant to train (all epochs); None: no plan
    replay_samples: int = 0
    heldout_samples: int = 0
    deferred_samples: int | None = None  # None: unknown (no plan was made); includes samples cut by the trainer
    cut_samples: int = 0  # new samples the trainer deferred whole when time ran short (of deferred_samples)
    returned_samples: int = 0  # samples of a rejected night put back (to pending, or to 'rejected')
    set_aside_samples: int = 0  # of those: rejected too often, set aside with their reason
    regression_samples: int | None = None  # in the regression set after this run (None: unknown)
    backlog_samples: int | None = None  # None: unknown (a crash report)
    backlog_tokens: int | None = None
    steps: int | None = None
    tokens_per_second: float | None = None
    samples_per_hour: float | None = None
    predicted_train_seconds: float | None = None
    actual_train_seconds: float | None = None
    stopped: Literal["deadline", "signal"] | None = None
    first_step_seconds: float | None = None  # from the child's start to the end of its first training step
    ranks: int = 1  # processes that trained the night (one per card; CPU processes where there is none)
    step_shape: StepShape | None = None
    load_info: dict[str, Any] = Field(default_factory=dict)  # backend's own figures (parameter counts, cache)
    expert_lora: ExpertLoraReport | None = None  # MoE bases: did every expert LoRA tensor train
    # evaluation and publication
    losses: Losses = Field(default_factory=Losses)
    # "<data>_<stage>": stage before (adapter in service), after (candidate), reference, base
    metrics: dict[str, EvalMetrics | None] = Field(default_factory=dict)
    not_evaluated: dict[str, str] = Field(default_factory=dict)  # data set -> why it was not evaluated
    gate: GateResult | None = None
    hotswap: list[HotswapOutcome] = Field(default_factory=list)
    hotswap_error: str | None = None
    # time and energy
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    gpu: GpuSummary | None = None
    started_at: float | None = None
    ended_at: float | None = None
    deadline: float | None = None


# ---- `nightshift validate`'s child: a FileCheck per file read as the inbox would (a JSON line each) ---


class RecordProblem(Frozen):
    line: int | None  # 1-based line (JSONL) or record number; None: the whole file
    reason: QuarantineReason
    detail: str


class FileCheck(Frozen):
    file: str
    source: str  # the [[sources]] whose format and field map were applied
    records: int = 0
    would_train: int = 0  # valid and new: would become pending samples
    known: int = 0  # valid, but already in the ledger
    repeated: int = 0  # valid, but repeats a record checked before
    tokens: int = 0  # of the records that would train
    already_ingested: bool = False  # the ledger has this very file: the inbox would skip it
    note: str | None = None  # e.g. the source's patterns would not pick this file up
    problems: list[RecordProblem] = Field(default_factory=list)


# ---- the child's events (JSON lines on its stdout) -------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ts: float = Field(default_factory=time.time)


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


class ResultEvent(_Event):
    event: Literal["result"] = "result"
    summary: RunSummary


ChildEvent = Annotated[
    PhaseEvent | PlanEvent | ProgressEvent | GpuEvent | HotswapEvent | OomSplitEvent | ResultEvent,
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


def nightshift_version() -> str:
    """The installed package's version (manifests, metrics, `--version`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nightshift")
    except PackageNotFoundError:
        return "unknown"


def new_run_id(night: str) -> str:
    """`2026-11-21-3f9a0c`: chosen by the supervisor (its log lines carry it), handed to the child."""
    return f"{night}-{secrets.token_hex(3)}"


def outcome_exit_code(outcome: Outcome) -> ExitCode:
    return {Outcome.failed: ExitCode.FAILED, Outcome.interrupted: ExitCode.INTERRUPTED}.get(outcome, ExitCode.OK)


def version_name(name: str, version: int) -> str:
    """`tiny`, 3 -> `tiny-v0003`: names are never reused (inference servers cache by name)."""
    return f"{name}-v{version:04d}"


def parse_version_name(name: str) -> tuple[str, int] | None:
    """`tiny-v0007` -> ("tiny", 7); anything else (a base model, a foreign adapter) -> None."""
    m = re.fullmatch(r"(?P<prefix>[A-Za-z0-9_.-]+?)-v(?P<version>\d{4,})", name)
    return (m["prefix"], int(m["version"])) if m else None
