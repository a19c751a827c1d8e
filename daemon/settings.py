"""One Settings model: the TOML file, each key overridable as NIGHTSHIFT_<SECTION>__<KEY>.

The job sections are the pydantic models defined next to their steps (jobs/*);
this module only composes them and adds the daemon's own. A bad config is reported
whole: every wrong key at once, named as the user writes it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from daemon.config_paths import UNSET, config_base, path_problems, rebase_paths, shorter
from daemon.metrics import MetricsConfig
from daemon.window import WindowConfig
from jobs.contract.redact import redact_text
from jobs.data.quarantine import QuarantineConfig
from jobs.data.sources import SourceConfig
from jobs.gpu.telemetry import GpuConfig
from jobs.hotswap import HotswapConfig
from jobs.learning.gate import EvalConfig
from jobs.learning.plan import PlanConfig
from jobs.night.config import ModelConfig, NightConfig
from jobs.night.several.config import AdapterConfig, problems, with_adapters
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
    lock_wait_seconds: float = Field(
        0.0, ge=0, description="once / plan / calibrate: how long to wait for a night that holds the state "
        "directory before exiting with status 5 (busy)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid",
                                      case_sensitive=False, env_ignore_empty=True)  # `VAR=` unsets, as in systemd

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
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)
    # several adapters in one night (jobs/night/several); none: one adapter, today's state directory
    adapters: list[AdapterConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _adapters_fit(self) -> Settings:
        found = problems(self.adapters, self._night_base())
        if found:  # one line per problem, each naming its key (format_error passes a "[..." message through)
            raise ValueError("\n  - ".join(found))
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: explicit arguments, then NIGHTSHIFT_* environment, then the TOML file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if settings_cls.model_config.get("toml_file"):
            sources.append(_RelativeToml(settings_cls))
        return tuple(sources)

    def night_config(self) -> NightConfig:
        """The night's config; with [[adapters]], each adapter's own night in it."""
        return with_adapters(self._night_base(), self.adapters)

    def _night_base(self) -> NightConfig:
        return NightConfig.model_validate(
            {k: getattr(self, k) for k in NightConfig.model_fields if k not in ("adapters", "shared_dir")},
            from_attributes=True)


class _RelativeToml(TomlConfigSettingsSource):
    """The TOML file, its relative paths made relative to the file (daemon/config_paths.py)."""

    def _read_file(self, file_path: Path) -> dict[str, Any]:  # utf-8-sig: a byte order mark (Notepad) is no error
        return rebase_paths(Settings, tomllib.loads(Path(file_path).read_text(encoding="utf-8-sig")),
                            config_base(file_path))


class ConfigError(ValueError):
    """Every problem of a config, one per line, each naming the key as the user writes it."""

    def __init__(self, path: Path | None, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        where = f"{path}: " if path else ""
        # a rejected URL is quoted back: its secrets redacted like everywhere else (jobs/contract/redact.py)
        super().__init__(redact_text(f"{where}{len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems)))


def key_name(loc: tuple[Any, ...]) -> tuple[str, str]:
    """('train', 'lora_rank') -> ('[train] lora_rank', 'NIGHTSHIFT_TRAIN__LORA_RANK')."""
    parts = [str(p) for p in loc]
    if not parts:
        return "(top level)", ENV_PREFIX
    at = next((i for i, p in enumerate(parts) if i and p.isdigit()), None)
    if at is not None:  # a table in an array: [[sources]] #2 inbox, [[hotswap.targets]] #1 name
        name = f"[[{'.'.join(parts[:at])}]] #{int(parts[at]) + 1}" + (f" {'.'.join(parts[at + 1:])}"
                                                                        if parts[at + 1:] else "")
    elif len(parts) == 1:
        name = parts[0]
    else:
        name = f"[{parts[0]}] {'.'.join(parts[1:])}"
    return name, ENV_PREFIX + "__".join(p.upper() for p in parts if not p.isdigit())


def _union_member(x: Any) -> bool:
    """A loc segment that names a validator or a union's member type, not a key the user wrote."""
    return isinstance(x, str) and (x.startswith(("function-", "tagged-union", "constrained-", "literal["))
                                   or "[" in x or x in ("int", "str", "float", "bool", "none"))


def merge_problems(problems: list[str]) -> list[str]:
    """One line per key: a union's members each complain about the same value ("≥ 1", or "auto")."""
    merged: dict[str, list[str]] = {}
    for p in problems:
        name, sep, rest = p.partition(": ")
        merged.setdefault(name if sep else p, []).append(rest if sep else "")
    return [f"{n}: " + "; or: ".join(dict.fromkeys(r)) if any(r) else n for n, r in merged.items()]


def user_loc(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[str], list[Any]]:
    """`loc` as the user wrote it, the keys its table accepts (for "did you mean") and the models it may be:
    Settings walked along it. A tagged union's tag (`vllm` in hotswap.targets.0.vllm.nmae) is not a key."""
    models: list[Any] = [Settings]
    out: list[Any] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            out.append(part)
            continue
        field = next((m.model_fields[part] for m in models if part in getattr(m, "model_fields", {})), None)
        tagged = [m for m in models if part in _tags(m)] if i + 1 < len(loc) else []  # the last: the key
        if field is None and tagged:
            models = tagged
            continue
        out.append(part)
        if field is None:
            return (*out, *loc[i + 1:]), [], []
        models = _models_in(field.annotation)
    return tuple(out), sorted({k for m in models for k in getattr(m, "model_fields", {})}), models


def _tags(model: Any) -> set[str]:
    """The values a model's `kind` discriminator takes (a member of a tagged union)."""
    field = getattr(model, "model_fields", {}).get("kind")
    return {str(a) for a in typing.get_args(field.annotation)} if field is not None else set()


def _models_in(tp: Any) -> list[Any]:
    """The pydantic models inside an annotation (Model, Model | None, list[Model], a union of models)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in _models_in(arg)]


def format_error(err: dict[str, Any]) -> str:
    loc = user_loc(tuple(x for x in err["loc"] if not _union_member(x)))[0]
    name, env = key_name(loc)
    in_list = any(isinstance(x, int) for x in loc)
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]).lower(), user_loc(loc[:-1])[1], n=1) if loc else []
        if not in_list and loc and env.upper() in map(str.upper, os.environ):  # the variable's, not the file's
            return f"{env}: unknown key" + (f" (did you mean {key_name((*loc[:-1], hint[0]))[1]}?)" if hint else "")
        return f"{name}: unknown key" + (f" (did you mean '{hint[0]}'?)" if hint else "")
    if err["type"] in ("union_tag_not_found", "union_tag_invalid"):  # [[hotswap.targets]] kind = "vlm"
        key, tag = str(err["ctx"]["discriminator"]).strip("'"), err["ctx"].get("tag")
        tags = sorted({t for m in user_loc(loc)[2] for t in _tags(m)})
        hint = difflib.get_close_matches(str(tag), tags, n=1) if tag is not None else []
        said = "required key is missing" if tag is None else f"{tag!r} is not a kind"
        return (f"{name} {key}: {said} (one of {', '.join(map(repr, tags))})"
                + (f"; did you mean {hint[0]!r}?" if hint else ""))
    if err["type"] == "missing":
        return f"{name}: required key is missing" + ("" if in_list else f" (or set {env})")
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("["):  # a validator that already names the key the user's way
        return msg
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {shorter(repr(got))})"
    origin = f" [from the environment: {env}]" if not in_list and env.upper() in map(str.upper, os.environ) else ""
    return f"{name}: {msg}{shown}{origin}"


def load_settings(path: Path | None = DEFAULT_CONFIG, **overrides: Any) -> Settings:
    """Read TOML + environment; raise ConfigError listing every problem."""
    blank: list[tuple[Any, ...]] = []
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(path, ["a directory, not a config file: give the TOML file in it"])
        if not path.is_file():
            raise ConfigError(path, ["config file not found"])
        try:
            rebase_paths(Settings, tomllib.loads(path.read_text(encoding="utf-8-sig")), config_base(path), blank)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(path, [f"not valid TOML: {e}"]) from None
        except UnicodeDecodeError as e:
            raise ConfigError(path, [f"not UTF-8 text ({e.reason} at byte {e.start})"]) from None
        except OSError as e:
            raise ConfigError(path, [f"cannot be read: {e.strerror or e}"]) from None
    config = SettingsConfigDict(**{**Settings.model_config, "toml_file": path})
    cls = type("FileSettings", (Settings,), {"model_config": config, "__module__": __name__})
    problems, masked = env_problems(os.environ)
    empty = dict.fromkeys(key_name(loc)[0] for loc in blank)  # read as "." (the working directory) if let through
    problems += [f"{name}: empty (a path is needed; a relative one starts at this file's folder)" for name in empty]
    for _ in range(8):  # a variable pydantic-settings cannot parse stops it: report it, leave it out, go on
        try:
            with _without(masked):
                s = cls(**overrides)
            if problems:
                raise ConfigError(path, problems + [p for p in check_paths(s) if p.split(":")[0] not in empty])
            return s
        except ValidationError as e:  # a validator's several problems are several lines ([[adapters]])
            errors = merge_problems([p for x in e.errors() for p in format_error(x).split("\n  - ")])
            with _without(masked):
                more = raw_path_problems(path, bad={p.split(":")[0] for p in errors} | set(empty))
            raise ConfigError(path, problems + errors + more) from None
        except SettingsError as e:
            found = _unparsable(str(e), masked)
            if not found:
                raise ConfigError(path, [*problems, f"the environment: {e}"]) from None
            problems += [p for _, p in found]
            masked += [name for name, _ in found]
    raise ConfigError(path, problems)


def check_paths(s: Settings, *, writes: bool = True) -> list[str]:
    """Problems a config can have beyond its types: things on disk it points at (`writes=False`: a command
    that only reads the state directory, as `plan`, runs on one this user may not write)."""
    from daemon.lineage import lineage_problems

    return path_problems(state_dir=s.state_dir, writes=writes, model_path=s.model.path, build=s.model.build,
                         inboxes=[src.inbox for src in s.sources], regression_set=s.eval.regression_set,
                         canary_set=s.eval.canary_set) + lineage_problems(s)


NOT_CONFIG = {"NIGHTSHIFT_LOG_LEVEL", "NIGHTSHIFT_LOG_FORMAT", "NIGHTSHIFT_CONFIG", "NIGHTSHIFT_NIGHT_LOCK_FD"}
def raw_path_problems(path: Path | None, *, bad: set[str]) -> list[str]:
    """The path checks on the raw config (TOML, then the environment) when it does not validate, so
    `check-config` reports types and paths together. Keys with a type problem of their own are skipped."""
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8-sig")) if path is not None else {}
        raw = rebase_paths(Settings, raw, config_base(path)) if path is not None else raw
    except (OSError, ValueError):
        raw = {}
    env = {k.upper(): v for k, v in os.environ.items()}

    def pick(section: str | None, key: str, label: str) -> Any:
        if label in bad:
            return UNSET
        name = ENV_PREFIX + (f"{section}__{key}" if section else key).upper()
        if name in env:
            return env[name]
        table = raw.get(section, {}) if section else raw
        return table.get(key, UNSET) if isinstance(table, dict) else UNSET

    sources = raw.get("sources")
    inboxes = None
    if "[[sources]]" not in bad and isinstance(sources, list):
        inboxes = [s.get("inbox") if isinstance(s, dict) and f"[[sources]] #{i} inbox" not in bad else None
                   for i, s in enumerate(sources, start=1)]
    build = pick("model", "build", "[model] build")
    state_dir = pick(None, "state_dir", "state_dir")
    return path_problems(state_dir="state" if state_dir is UNSET and "state_dir" not in bad else state_dir,
                         model_path=pick("model", "path", "[model] path"),
                         build=None if build is UNSET else build, inboxes=inboxes,
                         regression_set=pick("eval", "regression_set", "[eval] regression_set"),
                         canary_set=pick("eval", "canary_set", "[eval] canary_set"))


def env_problems(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """NIGHTSHIFT_* variables that cannot be right: an unknown section (`NIGHTSHIFT_TRIAN__LORA_RANK`),
    or a list/table that is not valid JSON. Returns (problems, variables to leave out). A variable
    without `__` that names no top-level key is not ours to judge (a secret named by `token_env`)."""
    fields = set(Settings.model_fields)
    problems, masked = [], []
    for name, value in sorted(environ.items()):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NOT_CONFIG:
            continue
        rest = upper[len(ENV_PREFIX):].lower()
        section = rest.split("__")[0]
        if "__" in rest and section not in fields:
            hint = difflib.get_close_matches(section, sorted(fields), n=1)
            problems.append(f"{name}: unknown section '{section}'" + (f" (did you mean '{hint[0]}'?)" if hint else
                            f"; sections: {', '.join(sorted(fields))}"))
            masked.append(name)
        elif "__" in rest or rest in fields:
            text = value.strip()
            if text[:1] in ("[", "{"):
                try:
                    json.loads(text)
                except ValueError as e:
                    problems.append(f"{name}: not valid JSON ({e}); lists and tables are written as JSON")
                    masked.append(name)
    return problems, masked


def _unparsable(message: str, masked: list[str]) -> list[tuple[str, str]]:
    """The variables behind pydantic-settings' 'error parsing value for field "x"' and why."""
    m = re.search(r'field "([^"]+)"', message)
    if not m:
        return []
    field = m.group(1).upper()
    names = [n for n in os.environ if n not in masked and
             (n.upper() == ENV_PREFIX + field or n.upper().startswith(ENV_PREFIX + field + "__"))]
    out = []
    for n in names:
        try:
            json.loads(os.environ[n])
        except ValueError:
            out.append((n, f"{n}: cannot be read ({os.environ[n][:40]!r}); lists and tables are written as JSON"))
    return out or [(n, f"{n}: cannot be read; lists and tables are written as JSON") for n in names]


@contextmanager
def _without(names: list[str]) -> Iterator[None]:
    """The environment without these variables, for one validation."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
