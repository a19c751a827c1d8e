"""Which config file, and `nightshift config --print | --schema`.

The file: `--config FILE` if given, else `$NIGHTSHIFT_CONFIG`, else `./config/nightshift.toml` (the
embedded default, in a checkout), else `/etc/nightshift/nightshift.toml` (a service install). The
one used is printed by `nightshift status` and `nightshift config --print`.

`--print` writes the resolved config as TOML that loads back to the same settings, each value
followed by where it came from: `default`, `file` or `environment: NIGHTSHIFT_...`. Unset
optional keys are shown commented out. `--schema` writes the JSON schema of the TOML file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from daemon.settings import DEFAULT_CONFIG, ENV_PREFIX, ConfigError, Settings
from jobs.contract.redact import redact_text, redact_value

CONFIG_ENV = "NIGHTSHIFT_CONFIG"
SYSTEM_CONFIG = Path("/etc/nightshift/nightshift.toml")
SEARCH_HELP = (f"TOML config file (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG}, else {SYSTEM_CONFIG}; "
               "`nightshift status` prints the one used)")


def resolve_config_path(explicit: Path | None, environ: Mapping[str, str] | None = None,
                        cwd: Path | None = None, system: Path = SYSTEM_CONFIG) -> tuple[Path, str]:
    """(path, how it was chosen). Raises ConfigError naming every place tried when there is none."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        return Path(explicit), "--config"
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), CONFIG_ENV  # named explicitly: a missing file is an error, no fallback
    local = (cwd or Path.cwd()) / DEFAULT_CONFIG
    if local.is_file():
        return (DEFAULT_CONFIG if cwd is None else local), "working directory"
    if system.is_file():
        return system, "system"
    raise ConfigError(None, [f"no config file: ${CONFIG_ENV} is not set, there is no ./{DEFAULT_CONFIG} "
                             f"here ({(cwd or Path.cwd())}) and no {system}; pass --config FILE"])


def add_command(sub: Any) -> None:
    p = sub.add_parser("config", help="print the resolved config (with where each value came from) or its schema",
                       description="Print the config as nightshift resolves it, or the JSON schema of the TOML file.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--print", action="store_true", dest="print_config",
                      help="the resolved config as TOML; each value says if it came from the default, the file "
                           "or the environment")
    what.add_argument("--schema", action="store_true", help="the JSON schema of the config file (needs no config)")
    p.add_argument("--json", action="store_true", help="with --print: {key: {value, source}} as JSON")
    p.set_defaults(func=cmd_config, needs_settings=lambda a: not a.schema)


def cmd_config(args: argparse.Namespace, s: Settings | None) -> int:
    if args.schema:
        print(json.dumps(schema(), indent=2))
        return 0
    assert s is not None
    raw = tomllib.loads(Path(args.config).read_text(encoding="utf-8"))
    if args.json:
        print(json.dumps({k: {"value": redact_value(v), "source": src} for k, v, src in leaves(s, raw)}, indent=2,
                         default=str))
    else:
        print(f"# {args.config} ({args.config_how}); NIGHTSHIFT_<SECTION>__<KEY> variables override it\n")
        print(redact_text(to_toml(s, raw)))  # a URL's secrets never reach a terminal or a paste
    return 0


def schema() -> dict[str, Any]:
    doc = Settings.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "nightshift configuration (TOML)", **{k: v for k, v in doc.items() if k != "title"}}


# ---- where each value came from --------------------------------------------------------------------

def env_source(path: tuple[str | int, ...], environ: Mapping[str, str]) -> str | None:
    """The NIGHTSHIFT_* variable that sets this key or a table holding it (a list is set whole)."""
    names = {k.upper(): k for k in environ}
    keys: list[str] = []
    for p in path:
        if isinstance(p, int):
            break
        keys.append(p)
    for n in range(len(keys), 0, -1):
        name = ENV_PREFIX + "__".join(k.upper() for k in keys[:n])
        if name in names:
            return names[name]
    return None


def source_of(path: tuple[str | int, ...], raw: Any, environ: Mapping[str, str]) -> str:
    var = env_source(path, environ)
    if var is not None:
        return f"environment: {var}"
    node = raw
    for p in path:
        if isinstance(p, int):
            if not isinstance(node, list) or p >= len(node):
                return "default"
        elif not isinstance(node, dict) or p not in node:
            return "default"
        node = node[p]
    return "file"


def leaves(s: Settings, raw: dict[str, Any], environ: Mapping[str, str] | None = None
           ) -> Iterator[tuple[str, Any, str]]:
    """("train.lora_rank", 16, "default"), ("sources[0].inbox", "...", "file"), ..."""
    env = os.environ if environ is None else environ

    def walk(v: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str, Any, str]]:
        if isinstance(v, dict) and path and _is_table(path):
            for k, x in v.items():
                yield from walk(x, (*path, k))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                yield from walk(x, (*path, i))
        else:
            yield _dotted(path), v, source_of(path, raw, env)

    for k, v in s.model_dump(mode="json").items():
        yield from walk(v, (k,))


def _is_table(path: tuple[str | int, ...]) -> bool:
    """Sections and array-of-table entries are tables; a dict-valued key (field_map) is one value."""
    return len(path) == 1 or isinstance(path[-1], int)


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


# ---- TOML that loads back ------------------------------------------------------------------------

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, dict):  # TOML has no null: a key not set is left out ([train.distributed] rdzv_endpoint)
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v)  # strings, numbers, booleans: JSON's spelling is TOML's


def to_toml(s: Settings, raw: dict[str, Any], environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    lines: list[str] = []

    def line(text: str, path: tuple[str | int, ...]) -> None:
        lines.append(f"{text:<56} # {source_of(path, raw, env)}")

    def table(d: dict[str, Any], path: tuple[str | int, ...]) -> None:
        nested = []
        for k, v in d.items():
            p = (*path, k)
            section = isinstance(v, dict) and len(path) == 0
            if section or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
                nested.append((k, v))
            elif v is None:
                line(f"# {_key(k)} = (not set)", p)
            else:
                line(f"{_key(k)} = {_value(v)}", p)
        for k, v in nested:
            name = ".".join(str(x) for x in path if isinstance(x, str)) + ("." if path else "") + k
            if isinstance(v, dict):
                lines.extend(["", f"[{name}]"])
                table(v, (*path, k))
            else:
                for i, x in enumerate(v):
                    lines.extend(["", f"[[{name}]]"])
                    table(x, (*path, k, i))

    table(s.model_dump(mode="json"), ())
    return "\n".join(lines)

