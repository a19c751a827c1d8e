"""The benchmark's settings: one typed object, built once from the command line, given to every worker.

The parent validates them (a bad flag is reported before any model is built) and hands them to each
worker process as JSON on its stdin; the worker validates them again where it reads them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from benchmarks.worker_table import WORKERS
from benchmarks.workload_table import WORKLOADS
from jobs.training.config import FP8Storage
from jobs.training.models.synthetic import PROFILES

PEAK_BF16 = 790e12  # dense bf16 FLOP/s measured on these H100/H200 machines (ANCHORS.md)
# MFU against each number format's own peak (issue 16). bf16: 790 measured, 989.4 datasheet dense.
# FP8 e4m3: 1978.9 datasheet dense (H100/H200 SXM); "measured" = the best row-wise FP8 GEMM measured on
# these H100/H200 (1,353-1,406 TFLOP/s with fast accumulation, measured): 1,400.
PEAKS = {"bf16": {"measured": 790e12, "datasheet": 989.4e12}, "fp8": {"measured": 1400e12, "datasheet": 1978.9e12}}


@dataclass(frozen=True)
class FP8Variant:
    """One `--compute` of ours with the frozen base on FP8: its [train] fp8_storage and fp8_keep_transposed, and
    what its rows' label adds."""

    storage: FP8Storage
    keep_transposed: bool
    label: str


# ours: bf16 base, or one of these (`[train] fp8_storage = "auto"` picks the copy or NF4: jobs/training/fp8/convert.py)
FP8_VARIANTS = {"fp8": FP8Variant("fp8", False, ", FP8 base"),
                "fp8-nf4": FP8Variant("nf4", False, ", FP8 base kept in NF4"),
                "fp8t": FP8Variant("fp8", True, ", FP8 base + transposed copy")}
COMPUTES = ("bf16", *FP8_VARIANTS)
STACKS = ("ours", "baseline", "unsloth", "trl")  # `bench`'s default: the published comparison


class BenchSettings(BaseModel):
    """Everything a run of the benchmark is told (the mode and the worker's own flags aside)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the model: a local HF directory, or an architecture built random-initialised under models_dir
    model: Path | None = None
    arch: str | None = None
    models_dir: Path = Path("/tmp/nightshift-models")
    build_4bit: bool = False
    out: Path = Path("bench-out")
    stacks: tuple[str, ...] = STACKS
    profiles: tuple[str, ...] = tuple(PROFILES)
    # ours: the token budget per step, chosen from measured memory
    max_vram_gb: float = Field(40.0, gt=0)
    headroom_gb: float = Field(3.0, ge=0, description="CUDA context + allocator slack")
    max_budget: int = Field(32768, ge=1, description="token budget per step, at most")
    budget: int = Field(0, ge=0, description="force the token budget (0: choose it)")
    probe_tokens: int = Field(2048, ge=2)
    ours_ckpt: bool = False
    compute: tuple[str, ...] = ("bf16",)  # ours: one worker per value (issue 16)
    ours_compute: str = "bf16"  # the worker's own value (set by the parent)
    fp8_learnable_steps: int = Field(30, ge=0, description="FP8 loss check: steps per curve (0: no check)")
    lora_r: int = Field(16, ge=1)
    # the timed window of every stack
    warmup: int = Field(3, ge=1)
    max_steps: int = Field(30, ge=1)
    seconds: float = Field(30.0, gt=0)
    data_tokens: int = Field(400_000, ge=1, description="random tokens generated per profile")
    trl_pack_length: int = Field(4096, ge=1)
    trl_configs: tuple[str, ...] = ("padding_free", "packing")
    peak_flops: float = Field(PEAK_BF16, gt=0)
    seed: int = 0
    prompt_share: float = Field(0.0, ge=0, lt=1, description="ours: share of each sample's tokens not trained on")
    token_file: Path | None = Field(None, description="ours: samples cut from this file's tokens, not random ids")
    state_dir: Path | None = None
    deadline: float = Field(0.0, ge=0, description="seconds for all stacks; later ones are skipped (0: none)")
    smi_log: Path | None = None
    smi_fields: str = "timestamp,power.draw,memory.used,utilization.gpu"
    gpu_events: Path | None = None
    drop_caches: bool = False
    torch_profile: str | None = None
    budget_seconds: tuple[float, float] = (60.0, 180.0)  # budget mode: alpaca, wiki
    # the moe stack (issue 15): a model built random-initialised in GPU memory, nightshift's MoE path
    in_memory: bool = Field(False, description="build --arch in GPU memory (NF4), no directory (moe stack)")
    vram_from_free: bool = Field(False, description="moe: the step budget's cap is the GPU memory free at start")
    profile_steps: int = Field(3, ge=1, description="moe: steps under torch.profiler per profile (--torch-profile)")
    trl_recipe: bool = Field(False, description="moe: also the published recipe (TRL SFTTrainer, padded 32/16)")
    # workloads mode: the published runs, each beside ours (benchmarks/workloads.py)
    workloads: tuple[str, ...] = ("exxact", "alpaca", "fixstars", "full")
    llama_arch: str = "llama3.1-8b"  # Exxact, Llama-3-8B Alpaca and full fine-tuning (built once, bf16)
    fixstars_archs: tuple[str, ...] = ("qwen3-8b",)  # built directly as NF4; add qwen3-32b for the 32B row
    exxact_steps: int = Field(60, ge=2, description="the recipe's 60 steps")
    alpaca_samples: int = Field(2000, ge=16)
    alpaca_eval: int = Field(200, ge=0)
    alpaca_epochs: int = Field(10, ge=1)
    alpaca_whole: bool = Field(False, description="run the whole Alpaca job (else a timed window, extrapolated)")
    full_cap_gb: float = Field(48.0, gt=0, description="full fine-tuning: the hard memory cap of both stacks")
    full_ckpt: str = Field("auto", pattern="^(auto|on|off)$", description="ours, full: checkpointing")
    # scaling mode: 1 vs N GPUs through torchrun (benchmarks/scaling.py)
    gpus: int = Field(2, ge=2, description="scaling: N of 1 vs N GPUs (CPU processes without a GPU)")
    scaling_workloads: tuple[str, ...] = ("ours", "exxact")

    @field_validator("stacks")
    @classmethod
    def _known_stacks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in WORKERS]
        if unknown:
            raise ValueError(f"unknown stack(s) {', '.join(unknown)}; known: {', '.join(WORKERS)}")
        return v

    @field_validator("profiles")
    @classmethod
    def _known_profiles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in PROFILES]
        if unknown or not v:
            raise ValueError(f"unknown profile(s) {', '.join(unknown)}; known: {', '.join(PROFILES)}")
        return v

    @field_validator("compute")
    @classmethod
    def _known_computes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in COMPUTES]
        if unknown or not v:
            raise ValueError(f"unknown compute(s) {', '.join(unknown)}; known: {', '.join(COMPUTES)}")
        return v

    @field_validator("workloads")
    @classmethod
    def _known_workloads(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
        return v

    @field_validator("trl_configs")
    @classmethod
    def _known_trl_configs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in ("padding_free", "packing")]
        if unknown:
            raise ValueError(f"unknown TRL config(s) {', '.join(unknown)}; known: padding_free, packing")
        return v

    @field_validator("scaling_workloads")
    @classmethod
    def _known_scaling_workloads(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [x for x in v if x not in ("ours", "exxact")]
        if unknown or not v:
            raise ValueError(f"unknown scaling workload(s) {', '.join(unknown)}; known: ours, exxact")
        return v

    @model_validator(mode="after")
    def _a_model(self) -> BenchSettings:
        if self.model is None and not self.arch:
            raise ValueError("give --model DIR or --arch NAME")
        return self

    @model_validator(mode="after")
    def _in_memory_is_the_moe_stacks(self) -> BenchSettings:
        if "moe" in self.stacks and not self.in_memory:
            raise ValueError("the moe stack builds its model in GPU memory: add --in-memory")
        others = [x for x in self.stacks if x != "moe"]
        if self.in_memory and others:
            raise ValueError(f"--in-memory: only the moe stack starts from a model built in memory, not "
                             f"{', '.join(others)}")
        if self.in_memory and not self.arch:
            raise ValueError("--in-memory needs --arch NAME (the architecture to build)")
        return self

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> BenchSettings:
        """From the parsed command line: every parser option that is a field (mode, worker flags: not)."""
        return cls.model_validate({k: v for k, v in vars(a).items() if k in cls.model_fields and v is not None})
