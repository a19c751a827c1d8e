"""[train]: how the adapter is trained (the job section the settings compose)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.data.render import OverlongPolicy, SpecialTokens


class TrainConfig(BaseModel):
    """[train]"""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "hf", "unsloth"] = "auto"  # auto: unsloth where CUDA and unsloth exist
    load_in_4bit: bool = True  # QLoRA base where CUDA exists; the CPU path trains plain LoRA
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    learning_rate: float = Field(2e-4, gt=0)
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
    checkpoint_every_seconds: float = Field(600.0, gt=0)
    seed: int = 0
    compute: Literal["bf16", "fp8", "auto"] = Field(
        "auto", description="the frozen base's matmuls: fp8 on FP8 tensor cores (compute capability >= 8.9); "
        "auto: fp8 where the card has them and `nightshift calibrate` measured the numerics check passing")
    fp8_keep_transposed: bool = Field(
        False, description="fp8: keep a transposed FP8 copy of every frozen weight for the backward "
        "(+1 byte per parameter) instead of transposing it in each backward")
