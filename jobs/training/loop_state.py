"""The training loop's typed state: what a checkpoint's state.json holds, and the detail of what a run did.

Typed so that a checkpoint is validated where it is read (a state.json that is not one names its problem and the
run resumes from the previous checkpoint instead of from a wrong position), and so that the night reads the
loop's figures as fields rather than dict keys. The JSON is the one the loop always wrote: checkpoints of
earlier versions resume as before (keys added since default to "nothing yet").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, StrictBool

from jobs.contract import ExpertLoraReport, StepShape

Cut = tuple[int, list[int]]  # (batch index the cut was made at, sample ids cut)
SlowStep = tuple[int, float, float]  # (optimizer step, seconds, typical seconds)


class LoopState(BaseModel):
    """Everything a resume needs besides the weights and the optimizer: the global position (rows of the batch
    sequence consumed), what was counted up to it, and what rebuilds the same batch sequence (step size, probe
    sizes, cuts). Saved with the weights of exactly this position, so a resume trains every later step once."""

    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants")  # a NaN loss reads back as NaN

    next_batch: NonNegativeInt  # required: a checkpoint without its position is never resumed from
    steps: NonNegativeInt  # optimizer (global) steps counted up to next_batch
    tokens: NonNegativeInt = 0
    seconds: NonNegativeFloat = 0.0
    loss_sum: float = 0.0
    loss_n: NonNegativeInt = 0
    halved: StrictBool = False  # an out-of-memory happened: every later step as two halves ("off" is refused)
    tokens_per_step: int | None = Field(None, ge=1)  # None: a checkpoint from before it was kept (the shape's)
    cuts: list[Cut] = []
    loss_curve: list[tuple[int, float]] = []  # (optimizer step, loss)
    probe_samples: list[int] = []
    warmup_tokens: NonNegativeInt = 0
    warmup_seconds: NonNegativeFloat = 0.0
    slow_steps: list[SlowStep] = []
    checkpoints: NonNegativeInt = 0  # periodic saves before this one (their seconds below)
    checkpoint_seconds: NonNegativeFloat = 0.0
    ramp_seconds: NonNegativeFloat = 0.0


class PreferenceDetail(BaseModel):
    """What a preference (DPO) night adds to the detail (jobs/night/preference.py fills it and reads it back)."""

    pairs: NonNegativeInt = 0
    not_pairs: NonNegativeInt = 0  # records of the plan that are not pairs: left pending
    policy_tokens: NonNegativeInt = 0
    reference_seconds: NonNegativeFloat = 0.0
    train_reward_accuracy: float | None = None
    train_margin: float | None = None
    heldout_pairs: dict[str, Any] | None = None  # jobs.night.preference.PairScores, validated where it is read


class TrainDetail(BaseModel):
    """The loop's figures that go into the manifest's "training" (besides steps, tokens and seconds), and the
    step shape as trained (a probe may have resized it). The defaults: a run that trained nothing."""

    batches: NonNegativeInt = 0
    batches_done: NonNegativeInt = 0
    halved: bool = False
    tokens_per_step: int | None = None
    gradient_checkpointing: bool | None = None
    step_shape_basis: str = ""
    batching: Literal["packed", "padded"] | None = None
    cuts: list[Cut] = []
    probe_samples: list[int] = []
    world_size: int = 1
    slow_steps: list[SlowStep] = []
    step_shape: StepShape | None = None
    expert_lora: ExpertLoraReport | None = None  # MoE bases: set by the night after training
    objective: Literal["sft", "dpo"] = "sft"
    preference: PreferenceDetail | None = None  # objective "dpo" only

    def manifest_fields(self) -> dict[str, Any]:
        """As the manifest's "training" keeps them (no expert_lora key where there are no experts)."""
        unset = {k for k in ("expert_lora", "preference") if getattr(self, k) is None}
        return self.model_dump(mode="json", exclude=unset)
