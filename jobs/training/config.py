"""[train]: how the adapter is trained (the job section the settings compose)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jobs.contract import Method
from jobs.data.render import OverlongPolicy, SpecialTokens
from jobs.training.ranks.topology import DistributedConfig

FULL_LEARNING_RATE = 2e-5  # full fine-tuning's default: every weight moves, so ten times smaller than LoRA's
FP8Storage = Literal["fp8", "nf4"]  # where an FP8 frozen base is held: an e4m3 copy, or its NF4 bytes kept
FP8StorageChoice = Literal["auto", "fp8", "nf4"]  # [train] fp8_storage: auto decides per model and memory budget

class TrainConfig(BaseModel):
    """[train]"""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "hf", "unsloth"] = "auto"  # auto: unsloth where CUDA and unsloth exist
    method: Method = Field(
        Method.qlora, description="qlora: 4-bit base + LoRA; lora: 16-bit base + LoRA; full: every weight "
        "(a version is then a whole model directory)")
    allow_method_change: bool = Field(
        False, description="continue a LoRA adapter trained as qlora with lora (or back): refused unless true")
    load_in_4bit: bool | None = None  # before `method`: true is qlora (4-bit base where CUDA exists); unset: method's
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    learning_rate: float = Field(2e-4, gt=0, description="default 2e-4, 2e-5 with method = \"full\"")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    epochs: int = Field(1, ge=1)
    batching: Literal["packed", "padded"] = Field(
        "packed", description="packed: samples concatenated into one row per step (positions reset, no attention "
        "across samples); padded: rows padded to the longest sample")
    tokens_per_step: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="packed: real tokens per step; auto: what `nightshift calibrate` measured fits "
        "under [gpu] max_vram_gb, else max_tokens_per_batch")
    batch_size: int = Field(8, ge=1, description="padded: samples per step at most")
    max_tokens_per_batch: int = Field(16384, ge=16, description="padded tokens per step at most")
    max_seq_length: int = Field(2048, ge=16)
    overlong: OverlongPolicy = "reject"
    special_tokens: SpecialTokens = Field(
        "escape", description="control-token text inside a record's content: escape (trained as text) or reject")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations to save memory; auto: calibrate's choice, else on")
    objective: Literal["sft", "dpo"] = Field(
        "sft", description="sft: next-token loss on the replies; dpo: preference pairs (chosen over rejected) "
        "against the version in service (jobs/training/preference/dpo.py); records that are no pair stay pending")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: how far from the version in service the policy may move "
                            "(larger: closer)")
    checkpoint_every_seconds: float = Field(600.0, gt=0)
    seed: int = 0
    compute: Literal["bf16", "fp8", "auto"] = Field(
        "auto", description="the frozen base's matmuls: fp8 on FP8 tensor cores (compute capability >= 8.9); "
        "auto: fp8 where the card has them and `nightshift calibrate` measured the numerics check passing")
    fp8_keep_transposed: bool = Field(
        False, description="fp8: keep a transposed FP8 copy of every frozen weight for the backward "
        "(+1 byte per parameter) instead of transposing it in each backward")
    fp8_storage: FP8StorageChoice = Field(
        "auto", description="fp8: where the frozen base is held: fp8, an e4m3 copy (1 byte per parameter); nf4, a "
        "4-bit base kept in NF4 (~0.52 bytes) and dequantised to the same e4m3 values at each use; auto: nf4 where "
        "the copy of the NF4 bases would take over 30 % of [gpu] max_vram_gb (else of the card's memory), the copy "
        "otherwise (jobs/training/fp8/convert.py's choose_storage says what was measured); a bf16 base gets its "
        "e4m3 copy either way")
    optimizer: Literal["auto", "adamw", "adamw_8bit"] = Field(
        "auto", description="adamw: torch AdamW (fused kernel on CUDA); adamw_8bit: bitsandbytes' 8-bit AdamW; "
        "auto: adamw unless full fine-tuning's weights, gradients and states would not fit (jobs/training/optim.py)")
    optimizer_in_backward: bool | Literal["auto"] = Field(
        "auto", description="step each weight as soon as its gradient is ready, so the whole model's gradients "
        "never exist at once (full fine-tuning; no gradient clipping then); auto: only where memory asks for it")

    # ---- several GPUs / hosts (jobs/training/ranks/topology.py, jobs/training/ranks/collectives.py) ----
    gpus: int | Literal["all"] = Field(
        1, description="processes training the night: one per card; without a GPU, N CPU processes (gloo)")
    devices: list[int] | None = Field(None, description="CUDA indices to use (default: the first `gpus` visible)")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @field_validator("gpus", mode="before")
    @classmethod
    def _count_or_all(cls, v: object) -> object:
        if v == "all":
            return v
        try:
            n = int(str(v))
        except ValueError:
            raise ValueError('expected a number of processes (1, 2, ...) or "all"') from None
        if n < 1:
            raise ValueError('must be at least 1, or "all"')
        return n

    @model_validator(mode="after")
    def _method(self) -> TrainConfig:
        if self.method is not Method.qlora and self.load_in_4bit:
            raise ValueError(f'[train] load_in_4bit = true contradicts method = "{self.method.value}" (a 16-bit '
                             'base): leave load_in_4bit out, or use method = "qlora"')
        if self.method is Method.qlora and self.load_in_4bit is False:
            raise ValueError('[train] load_in_4bit = false: say method = "lora" (LoRA on a 16-bit base) instead')
        if self.fp8_storage == "nf4" and self.fp8_keep_transposed:
            raise ValueError('[train] fp8_storage = "nf4" contradicts fp8_keep_transposed = true (the kept copy is '
                             'e4m3): choose one')
        if self.objective == "dpo" and self.gpus != 1:
            raise ValueError('[train] objective = "dpo" trains on one process for now: set gpus = 1')
        if self.method is Method.full and "learning_rate" not in self.model_fields_set:
            self.learning_rate = FULL_LEARNING_RATE
        return self

    @property
    def quantized_base(self) -> bool:
        """The base is loaded in 4-bit (where CUDA exists): qlora only."""
        return self.method is Method.qlora
