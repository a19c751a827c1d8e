"""[train]: how the adapter is trained (the job section the settings compose)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobs.data.render import OverlongPolicy
from jobs.training.topology import DistributedConfig


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
    tokens_per_step: int | Literal["auto"] = Field(
        "auto", description="packed: real tokens per step; auto: what `nightshift calibrate` measured fits "
        "under [gpu] max_vram_gb, else max_tokens_per_batch")
    batch_size: int = Field(8, ge=1, description="padded: samples per step at most")
    max_tokens_per_batch: int = Field(16384, ge=16, description="padded tokens per step at most")
    max_seq_length: int = Field(2048, ge=16)
    overlong: OverlongPolicy = "reject"
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations to save memory; auto: calibrate's choice, else on")
    checkpoint_every_seconds: float = Field(600.0, gt=0)
    seed: int = 0
    # ---- several GPUs / hosts (jobs/training/topology.py, jobs/training/distributed.py) ----
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
