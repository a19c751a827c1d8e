"""[[adapters]]: what an operator writes, checked whole, and each adapter's own night config from it.

Each adapter's night is today's night on its own state directory (`StatePaths.adapter(name)`), so every
guarantee of one (exactly-once, resume, gate, rollback, doctor) holds for each by construction; its
overrides are merged over the shared sections and validated as those sections are.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.learning.gate import EvalConfig
from jobs.learning.plan import PlanConfig
from jobs.night.config import AdapterNight, NightConfig
from jobs.store.paths import StatePaths
from jobs.training.config import TrainConfig


@dataclass(frozen=True)
class SectionKeys:
    """Marks a table of some of a section's keys: daemon/config_paths.py rebases its relative paths as that
    section's own (an adapter's `eval = { regression_set = "x.jsonl" }` is relative to the config file)."""

    section_model: type[BaseModel]

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
_OVERRIDABLE = ("train", "plan", "eval")


class AdapterConfig(BaseModel):
    """[[adapters]]: one adapter trained in the shared night."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN, description="versions are <name>-vNNNN; its state: by-adapter/<name>/")
    sources: list[str] = Field(min_length=1, description="names of the [[sources]] it trains on (each feeds one)")
    weight: float = Field(1.0, gt=0, description="its priority: shares of the window are proportional to it")
    min_share: float = Field(0.0, ge=0, lt=1, description="a floor of the window it gets (if it has that "
                             "much to train), so no adapter starves")
    train: Annotated[dict[str, Any], SectionKeys(TrainConfig)] = Field(
        default_factory=dict, description="keys of [train] this adapter sets otherwise (its LoRA shape, method...)")
    plan: Annotated[dict[str, Any], SectionKeys(PlanConfig)] = Field(
        default_factory=dict, description="keys of [plan] (e.g. replay_share)")
    eval: Annotated[dict[str, Any], SectionKeys(EvalConfig)] = Field(
        default_factory=dict, description="keys of [eval] (e.g. the gate's rules, its regression set)")
    hotswap: list[str] | None = Field(None, description="names of the [hotswap] targets it is announced to "
                                      "(default: every one)")


def _merged(base: BaseModel, over: dict[str, Any]) -> Any:
    """The shared section with this adapter's keys set over it, validated as the section is."""
    return type(base).model_validate({**base.model_dump(exclude_unset=True), **over})


def problems(adapters: list[AdapterConfig], cfg: NightConfig) -> list[str]:
    """Every problem of the [[adapters]] tables at once, each naming the key as written."""
    out: list[str] = []
    if not adapters:
        return out
    first: dict[str, int] = {}
    feeds: dict[str, list[str]] = {}
    known = [s.name for s in cfg.sources]
    targets = [t.name for t in cfg.hotswap.targets]
    for i, a in enumerate(adapters, start=1):
        where = f"[[adapters]] #{i}"
        if a.name in first:
            out.append(f"{where} name: {a.name!r} is the name of [[adapters]] #{first[a.name]} too: names are unique")
        first.setdefault(a.name, i)
        for src in a.sources:
            if src not in known:
                hint = difflib.get_close_matches(src, known, n=1)
                out.append(f"{where} sources: {src!r} is no [[sources]] name" +
                           (f" (did you mean {hint[0]!r}?)" if hint else f" (they are: {', '.join(known) or 'none'})"))
            feeds.setdefault(src, []).append(a.name)
        for section in _OVERRIDABLE:
            over = getattr(a, section)
            if over:
                out += _override_problems(where, section, getattr(cfg, section), over)
        for t in a.hotswap or []:
            if t not in targets:
                out.append(f"{where} hotswap: {t!r} is no [hotswap] target's name (they are: "
                           f"{', '.join(targets) or 'none'})")
    for src, names in feeds.items():
        if len(names) > 1 and src in known:
            out.append(f"[[sources]] {src!r}: named by [[adapters]] {' and '.join(repr(n) for n in names)}: "
                       "a source feeds exactly one adapter")
    for src in known:
        if src not in feeds:
            out.append(f"[[sources]] {src!r}: named by no [[adapters]]: with [[adapters]], each source feeds one")
    if sum(a.min_share for a in adapters) > 1:
        out.append(f"[[adapters]] min_share: they add up to {sum(a.min_share for a in adapters):g}, more than the "
                   "whole window (1)")
    return out


def _override_problems(where: str, section: str, base: BaseModel, over: dict[str, Any]) -> list[str]:
    try:
        _merged(base, over)
    except ValidationError as e:
        out = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                hint = difflib.get_close_matches(str(err["loc"][-1]), sorted(type(base).model_fields), n=1)
                out.append(f"{where} {section}.{key}: unknown key" + (f" (did you mean '{hint[0]}'?)" if hint else ""))
            else:
                got = err.get("input")
                shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
                msg = str(err["msg"]).removeprefix("Value error, ")
                out.append(f"{where} {section}.{key}: {msg}{shown}" if key else f"{where} {section}: {msg}")
        return out
    return []


def adapter_night(base: NightConfig, a: AdapterConfig) -> NightConfig:
    """One adapter's night: its own state directory, sources, overrides and hot-swap targets; the base
    model, the card's and the quarantine's settings shared."""
    hotswap = base.hotswap
    if a.hotswap is not None:
        hotswap = hotswap.model_copy(update={"targets": [t for t in hotswap.targets if t.name in a.hotswap]})
    return base.model_copy(update={
        "state_dir": StatePaths(base.state_dir).adapter(a.name).root,
        "shared_dir": base.state_dir,
        "model": base.model.model_copy(update={"name": a.name}),
        "sources": [s for s in base.sources if s.name in a.sources],
        **{section: _merged(getattr(base, section), getattr(a, section)) for section in _OVERRIDABLE},
        "hotswap": hotswap,
        "adapters": [],
    })


def with_adapters(base: NightConfig, adapters: list[AdapterConfig]) -> NightConfig:
    """The whole night's config: with [[adapters]], each adapter's own night in it (in config order)."""
    if not adapters:
        return base
    return base.model_copy(update={"adapters": [
        AdapterNight(name=a.name, weight=a.weight, min_share=a.min_share, night=adapter_night(base, a))
        for a in adapters]})
