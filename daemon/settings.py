"""One Settings model: the TOML file, each key overridable as NIGHTSHIFT_<SECTION>__<KEY>.

The job sections are the pydantic models defined next to their steps (jobs/*);
this module only composes them and adds the daemon's own. A bad config is reported
whole: every wrong key at once, named as the user writes it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from daemon.metrics import MetricsConfig
from daemon.window import WindowConfig
from jobs.data.sources import SourceConfig
from jobs.evaluate import EvalConfig
from jobs.gpu import GpuConfig
from jobs.hotswap import HotswapConfig
from jobs.night.config import ModelConfig, NightConfig
from jobs.plan import PlanConfig
from jobs.store.adapters import RegistryConfig
from jobs.training.config import TrainConfig

ENV_PREFIX = "NIGHTSHIFT_"
DEFAULT_CONFIG = Path("config/nightshift.toml")


class LogConfig(BaseModel):
    """[log]"""

    model_config = ConfigDict(extra="forbid")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["auto", "json", "console"] = "auto"  # auto: console on a TTY, JSON otherwise


class DaemonConfig(BaseModel):
    """[daemon]: how the service supervises the night's child."""

    model_config = ConfigDict(extra="forbid")
    stop_grace_seconds: float = Field(300.0, gt=0, description="time the child gets to checkpoint and save")
    max_attempts: int = Field(3, ge=1, description="attempts per night (a crashed child is retried)")
    retry_backoff_seconds: float = Field(60.0, ge=0, description="first retry delay; doubles each time")
    min_free_disk_gb: float = Field(5.0, ge=0, description="pre-flight: free space needed in state_dir")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid",
                                      case_sensitive=False)

    state_dir: Path = Path("state")
    model: ModelConfig
    sources: list[SourceConfig] = Field(default_factory=list)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    hotswap: HotswapConfig = Field(default_factory=HotswapConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    window: WindowConfig = Field(default_factory=WindowConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: explicit arguments, then NIGHTSHIFT_* environment, then the TOML file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("toml_file"):
            sources.append(TomlConfigSettingsSource(settings_cls))
        return tuple(sources)

    def night_config(self) -> NightConfig:
        return NightConfig.model_validate(
            {k: getattr(self, k) for k in NightConfig.model_fields}, from_attributes=True)


class ConfigError(ValueError):
    """Every problem of a config, one per line, each naming the key as the user writes it."""

    def __init__(self, path: Path | None, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def key_name(loc: tuple[Any, ...]) -> tuple[str, str]:
    """('train', 'lora_rank') -> ('[train] lora_rank', 'NIGHTSHIFT_TRAIN__LORA_RANK')."""
    parts = [str(p) for p in loc]
    if not parts:
        return "(top level)", ENV_PREFIX
    if len(parts) >= 2 and parts[1].isdigit():  # a table in an array: [[sources]] #2 inbox
        name = f"[[{parts[0]}]] #{int(parts[1]) + 1}" + (f" {'.'.join(parts[2:])}" if parts[2:] else "")
    elif len(parts) == 1:
        name = parts[0]
    else:
        name = f"[{parts[0]}] {'.'.join(parts[1:])}"
    return name, ENV_PREFIX + "__".join(p.upper() for p in parts if not p.isdigit())


def format_error(err: dict[str, Any]) -> str:
    loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and x.startswith(("function-", "tagged-union"))))
    name, env = key_name(loc)
    in_list = any(isinstance(x, int) for x in loc)
    if err["type"] == "extra_forbidden":
        return f"{name}: unknown key"
    if err["type"] == "missing":
        return f"{name}: required key is missing" + ("" if in_list else f" (or set {env})")
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("["):  # a validator that already names the key the user's way
        return msg
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    origin = f" [from the environment: {env}]" if not in_list and env.upper() in map(str.upper, os.environ) else ""
    return f"{name}: {msg}{shown}{origin}"


def load_settings(path: Path | None = DEFAULT_CONFIG, **overrides: Any) -> Settings:
    """Read TOML + environment; raise ConfigError listing every problem."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(path, ["config file not found"])
        try:
            tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(path, [f"not valid TOML: {e}"]) from None
    config = SettingsConfigDict(**{**Settings.model_config, "toml_file": path})
    cls = type("FileSettings", (Settings,), {"model_config": config, "__module__": __name__})
    try:
        return cls(**overrides)
    except ValidationError as e:
        raise ConfigError(path, [format_error(x) for x in e.errors()]) from None


def check_paths(s: Settings) -> list[str]:
    """Problems a config can have beyond its types: things on disk it points at."""
    problems = []
    if not (Path(s.model.path) / "config.json").is_file() and s.model.build is None:
        problems.append(f"[model] path: {s.model.path} is not a local model directory (no config.json)")
    for i, src in enumerate(s.sources, start=1):
        if not Path(src.inbox).is_dir():
            problems.append(f"[[sources]] #{i} inbox: {src.inbox} is not a directory")
    if s.eval.regression_set is not None and not Path(s.eval.regression_set).is_file():
        problems.append(f"[eval] regression_set: {s.eval.regression_set} does not exist")
    if not s.sources:
        problems.append("[[sources]]: no source configured: nothing would ever be trained")
    return problems
