"""What a run leaves behind: its summary (the ledger's `runs.summary`), the gate, the hot-swaps."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.contract.basics import Frozen, Method, Outcome, QuarantineReason
from jobs.contract.calibration import Plan, StepShape

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
    against: Literal["service", "reference", "base", "server"] = "service"  # whose figures `before` holds
    before: float | None
    after: float | None
    change: float | None  # after - before (positive: the metric went up)
    change_pct: float | None
    rule: str
    passed: bool
    skipped: str | None = None  # why the rule had no data (then passed unless required)
    p_value: float | None = None  # the paired test's, where the point figures broke the rule (jobs/learning/gate.py)
    paired: int | None = None  # samples both models were scored on


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
    """Did the adapter train a mixture-of-experts base's experts? Counted every night (jobs/training/moe/lora.py).

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


class AdapterShare(BaseModel):
    """[[adapters]]: one adapter's claim on the night's window, planned before anything trains."""

    model_config = ConfigDict(extra="forbid")
    adapter: str
    weight: float
    min_share: float
    pending_samples: int = 0
    pending_tokens: int = 0  # to train (each epoch counted), after the pull
    tokens_per_second: float | None = None  # the measured (or prior) rate of its throughput key
    overhead_seconds: float = 0.0  # load + evaluate + publish, measured (or prior)
    key: str = ""  # its throughput key: shared by adapters of the same base, method and shape
    basis: str = ""
    demand_seconds: float | None = None  # the training time of everything it has (None: unknown)
    seconds: float = 0.0  # its slice of the window: its overhead and its training time
    share: float = 0.0  # of the window


class RunSummary(BaseModel):
    """Everything a night's run reports: the child's last event, the ledger's `runs.summary`, the
    source of the CLI's table and of the last-run metrics."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    run_id: str = ""
    night: str = ""
    adapter: str = ""  # the adapter this run trained ([[adapters]]); "" in a config of one adapter
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
    preference_pairs: int = 0  # of trained_samples, pairs trained with the preference objective (a finished run)
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
    kl_from_service: float | None = None  # KL(candidate || adapter in service) on tonight's data, nats/token
    isolated: dict[str, str] = Field(default_factory=dict)  # file -> what a rejection did with it
    gate: GateResult | None = None
    hotswap: list[HotswapOutcome] = Field(default_factory=list)
    hotswap_error: str | None = None
    # time and energy
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    gpu: GpuSummary | None = None
    started_at: float | None = None
    ended_at: float | None = None
    deadline: float | None = None
    # [[adapters]]: the night's own summary lists each adapter's run and the plan that shared the window
    adapters: list[RunSummary] = Field(default_factory=list)
    shares: list[AdapterShare] = Field(default_factory=list)


# ---- `nightshift validate`'s child: a FileCheck per file read as the inbox would (a JSON line each) ---


class RecordProblem(Frozen):
    line: int | None  # 1-based line (JSONL) or record number; None: the whole file
    reason: QuarantineReason
    detail: str
    item: int | None = None  # 1-based element of a JSON array (several can share a line)

    @property
    def where(self) -> str:
        """`line 4`, `line 1, record 3` (a JSON array on one line), `the whole file`."""
        if self.line is None:
            return "the whole file"
        return f"line {self.line}" + (f", record {self.item}" if self.item is not None else "")


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
