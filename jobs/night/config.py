"""[model] and the night's whole config: the job sections the child receives on stdin."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobs.data.quarantine import QuarantineConfig
from jobs.data.sources import SourceConfig
from jobs.gpu.telemetry import GpuConfig
from jobs.hotswap import HotswapConfig
from jobs.learning.gate import EvalConfig
from jobs.learning.plan import PlanConfig
from jobs.training.config import TrainConfig


class ModelConfig(BaseModel):
    """[model]"""

    model_config = ConfigDict(extra="forbid")
    path: Path = Field(description="local Hugging Face model directory (nothing is downloaded)")
    name: str = Field("adapter", pattern=r"^[A-Za-z0-9_.-]+$", description="adapter name: <name>-v0001")
    build: str | None = Field(
        None, description="build this random-initialised model at `path` when it is missing: \"tiny-llama\" "
        "(the demo), or \"in-memory:<arch>\" (config and tokenizer at `path`, weights drawn in GPU memory "
        "each night: models whose weights outgrow the disk, e.g. in-memory:gpt-oss-120b)")

    @field_validator("build")
    @classmethod
    def _known_build(cls, v: str | None) -> str | None:
        from jobs.training.models.architectures import ARCHITECTURES  # no torch: a table

        if v is None or v == "tiny-llama":
            return v
        arch = v.removeprefix("in-memory:")
        if v.startswith("in-memory:") and arch in ARCHITECTURES:
            return v
        raise ValueError(f"{v!r} is not \"tiny-llama\" or \"in-memory:<arch>\" with a known arch "
                         f"({', '.join(ARCHITECTURES)})")


class NightConfig(BaseModel):
    """Everything the child needs: the job sections of the settings."""

    model_config = ConfigDict(extra="forbid")
    state_dir: Path
    model: ModelConfig
    sources: list[SourceConfig] = Field(default_factory=list)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    hotswap: HotswapConfig = Field(default_factory=HotswapConfig)  # no targets: nothing announced
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)
    # [[adapters]]: the top state directory, where what the adapters share lives (measured throughput,
    # model caches); None: this config is the whole night (one adapter, today's layout)
    shared_dir: Path | None = None
    adapters: list[AdapterNight] = Field(default_factory=list)  # [[adapters]]: each one's own night, in order


class AdapterNight(BaseModel):
    """One adapter of a night of several: its own night config (its own state directory) and its claim
    on the window (jobs/night/several/share.py)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float = Field(1.0, gt=0)
    min_share: float = Field(0.0, ge=0, le=1)
    night: NightConfig


NightConfig.model_rebuild()
