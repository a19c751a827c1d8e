"""What `nightshift calibrate` hands the night, and the plan the night makes from it."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.contract.basics import Frozen

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
    loss_max_rel_diff: float | None = Field(None, description="max over 5-step windows of |fp8 - bf16| / bf16's "
                                            "first window (its starting loss)")
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
