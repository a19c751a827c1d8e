"""Relative paths in a config file are relative to that file, not to the working directory.

`cd /elsewhere && nightshift --config /srv/ns/nightshift.toml status` must read /srv/ns's state, not create
./state here. The rebasing walks the Settings model's field types, so every Path-typed key (state_dir, [model]
path, [[sources]] inbox, [eval] regression_set, the hot-swap secret files...) is covered, including ones added
later. Values from the environment or the command line keep the working directory (a shell's convention).
`path_problems` checks what the paths point at, each check in its own guard: a name the kernel refuses (too
long, a loop of links) is a problem of that key, not a traceback.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel


def rebase_paths(model: type[BaseModel], data: dict[str, Any], base: Path, blank: list[tuple[Any, ...]] | None = None,
                 loc: tuple[Any, ...] = ()) -> dict[str, Any]:
    """`data` (a TOML table for `model`) with each relative path under `base`; everything else as it was.
    `blank` collects where a path is an empty string (pydantic reads "" as ".": the working directory)."""
    out = dict(data)
    blank = [] if blank is None else blank
    by_key = {(f.alias or n).lower(): f for n, f in model.model_fields.items()}
    for key, value in data.items():
        field = by_key.get(key.lower()) if isinstance(key, str) else None
        section = next((m.section_model for m in field.metadata if hasattr(m, "section_model")), None) \
            if field is not None else None
        if section is not None and isinstance(value, dict):  # some keys of a section ([[adapters]] eval = {...})
            out[key] = rebase_paths(section, value, base, blank, (*loc, key))
        elif field is not None:
            out[key] = _rebase(field.annotation, value, base, blank, (*loc, key))
    return out


def _rebase(tp: Any, value: Any, base: Path, blank: list[tuple[Any, ...]], loc: tuple[Any, ...]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _rebase(args[0], value, base, blank, loc)
    if tp is Path:
        if isinstance(value, str) and value.strip():
            p = Path(value).expanduser()
            if p.is_absolute():
                return str(p)
            # "../state" from config/ is the checkout's state/, shown so (not ".../config/../state"), as the kernel
            # would walk it (a symbolic link before the "..": its target's parent)
            return str((base / p).resolve() if ".." in p.parts else base / p)
        if isinstance(value, str):
            blank.append(loc)
        return value
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return rebase_paths(tp, value, base, blank, loc) if isinstance(value, dict) else value
    if origin in (list, tuple, set, frozenset) and isinstance(value, list) and args:
        return [_rebase(args[0], v, base, blank, (*loc, i)) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for member in args:  # the member the value's shape fits (a str for a Path, a table for a model)
            if member is Path and isinstance(value, str):
                return _rebase(member, value, base, blank, loc)
            if isinstance(member, type) and issubclass(member, BaseModel) and isinstance(value, dict):
                return _rebase(member, value, base, blank, loc)
            if typing.get_origin(member) in (list, tuple) and isinstance(value, list):
                return _rebase(member, value, base, blank, loc)
    return value


def config_base(path: Path) -> Path:
    """The folder a config file's relative paths start from (absolute: the process may change directory)."""
    return Path(path).absolute().parent


UNSET: Any = object()


def shorter(text: str, limit: int = 120) -> str:
    """A value as a message quotes it: a 5 MB string is not echoed whole."""
    return text if len(text) <= limit else f"{text[:limit - 40]}…{text[-20:]} ({len(text):,} characters)"


def path_problems(*, state_dir: Any = UNSET, writes: bool = True, model_path: Any = UNSET, build: Any = None,
                  inboxes: list[Any] | None = None, regression_set: Any = None, canary_set: Any = None) -> list[str]:
    """What the config points at on disk; a value left UNSET (or not a path) is not checked."""
    problems: list[str] = []

    def check(label: str, value: Any, problem: Any) -> None:
        if not isinstance(value, str | Path):
            return
        try:
            said = problem(Path(value))
        except OSError as e:  # ENAMETOOLONG, ELOOP...: the kernel's word for this key's path
            said = f"cannot be used: {e.strerror or e}"
        if said:
            problems.append(f"{label}: {shorter(str(value))} {said}")

    def state(sd: Path) -> str | None:
        base = next((p for p in (sd, *sd.absolute().parents) if p.exists()), sd)
        if sd.exists() and not sd.is_dir():
            return "is not a directory"
        if writes and (not base.is_dir() or not os.access(base, os.W_OK | os.X_OK)):
            return "is not writable" if base == sd else f"cannot be created ({shorter(str(base))} is not writable)"
        return None

    check("state_dir", state_dir, state)
    if build is None:
        check("[model] path", model_path, lambda p: None if (p / "config.json").is_file()
              else "is not a local model directory (no config.json)")
    for i, inbox in enumerate(inboxes or [], start=1):
        check(f"[[sources]] #{i} inbox", inbox, lambda p: "is not a directory" if not p.is_dir()
              else None if os.access(p, os.R_OK | os.X_OK) else "is not readable")
    check("[eval] regression_set", regression_set, lambda p: None if p.is_file() else "does not exist")
    if canary_set != regression_set:
        check("[eval] canary_set", canary_set, lambda p: None if p.is_file() else "does not exist")
    if inboxes is not None and not inboxes:
        problems.append("[[sources]]: no source configured: nothing would ever be trained")
    return problems
