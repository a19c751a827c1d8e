"""`nightshift adapters ...` and `nightshift hotswap`: the operator's hands on published versions.

Wired into daemon/cli.py by `add_commands(subparsers)`. Each handler takes (args, settings)
like the other commands. Imports no torch (jobs.store.adapters, jobs.store.registry, jobs.store.ledger and
jobs.hotswap do not), so these stay instant and safe to run next to a night: every change
takes the state directory's lock, the one the night's publish takes.

Exit codes: 0 done; 1 refused (integrity, unknown version, nothing to roll back to, damaged state);
4 `current` moved but at least one hot-swap target failed (the move stands; see the ledger);
5 busy: another nightshift process held the registry lock longer than [registry] lock_timeout_seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from daemon.adapters_view import diff_lines, show_lines
from daemon.tables import grid
from jobs.contract import ExitCode, RunSummary
from jobs.contract.redact import redact_text, redact_value
from jobs.gpu.cost import summary_cost
from jobs.hotswap import HotswapConfig, HotswapOutcome, versions
from jobs.store.adapters import AdapterError, Adapters, RegistryConfig, VersionInfo, diff
from jobs.store.locking import LockTimeout
from jobs.store.paths import StatePaths
from jobs.store.registry import IntegrityError
from jobs.store.schema import published_dirs


def add_commands(sub: Any) -> None:
    """Register `adapters` (with its sub-commands) and `hotswap` on the CLI's subparsers."""
    ap = sub.add_parser("adapters", help="list, inspect, promote, roll back, pin and prune adapter versions")
    asub = ap.add_subparsers(dest="adapters_cmd", required=True)
    p = asub.add_parser("list", help="every version: outcome, metrics, which is in service, pinned")
    p.add_argument("--json", action="store_true", help="the same as JSON")
    p.set_defaults(func=cmd_list)
    p = asub.add_parser("show", help="a version's figures and lineage (the whole manifest with --json)")
    p.add_argument("version", help="3, v0003, <name>-v0003 or current")
    p.add_argument("--json", action="store_true", help="the manifest only")
    p.set_defaults(func=cmd_show)
    p = asub.add_parser("diff", help="what differs between two versions (a list such as the loss curve: one line; "
                          "every key with --json)")
    p.add_argument("a", help="the first version: 3, v0003, <name>-v0003 or current")
    p.add_argument("b", help="the second version")
    p.add_argument("--json", action="store_true", help="the differences as JSON")
    p.set_defaults(func=cmd_diff)
    p = asub.add_parser("promote", help="verify a kept version, put it in service, notify the hot-swap targets")
    p.add_argument("version", help="3, v0003, <name>-v0003 or current")
    p.set_defaults(func=cmd_promote)
    p = asub.add_parser("rollback", help="back to the version in service before the current one; notify targets")
    p.set_defaults(func=cmd_rollback)
    p = asub.add_parser("pin", help="keep a version whatever the retention says")
    p.add_argument("version", help="3, v0003, <name>-v0003 or current")
    p.set_defaults(func=cmd_pin)
    p = asub.add_parser("unpin", help="let retention decide again")
    p.add_argument("version", help="3, v0003, <name>-v0003 or current")
    p.set_defaults(func=cmd_unpin)
    p = asub.add_parser(
        "prune",
        help="apply retention: keep the last [registry] keep_promoted promoted, pinned ones and the one in service",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    p.set_defaults(func=cmd_prune)
    for cmd in asub.choices.values():
        _adapter_option(cmd)
    p = sub.add_parser("hotswap", help="send the adapter in service to every [hotswap] target again")
    _adapter_option(p)
    p.add_argument("--version", help="send this kept version instead (it is NOT put in service)")
    p.add_argument("--json", action="store_true", help="the targets' outcomes as JSON")
    p.set_defaults(func=cmd_hotswap)


def _adapter_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", metavar="NAME", help="[[adapters]]: whose versions (required where the config has "
                   "several adapters; a config of one has none to name)")


class WithTargets(Adapters):
    """The store's versions with the [hotswap] targets that promote, rollback and hotswap tell."""

    def __init__(self, state_dir: Any, *, hotswap: HotswapConfig, cfg: RegistryConfig, read_only: bool = False,
                 price_per_gpu_hour: float | None = None) -> None:
        super().__init__(state_dir, cfg=cfg, read_only=read_only)
        self.hotswap_cfg = hotswap
        self.price_per_gpu_hour = price_per_gpu_hour  # [gpu]: `show`'s dollars per million tokens


def open_adapters(s: Any, *, read_only: bool = False, adapter: str | None = None) -> WithTargets:
    """Settings -> Adapters; [hotswap] / [registry] default to nothing configured / defaults. `adapter`
    ([[adapters]]): whose versions (required where the config has several adapters)."""
    state_dir, hotswap = s.state_dir, getattr(s, "hotswap", None) or HotswapConfig()
    several = getattr(s, "adapters", None) or []
    if adapter is not None and not several:
        raise AdapterError(f"--adapter {adapter}: this config has no [[adapters]] (its one adapter needs no name)")
    if several:
        names = [a.name for a in several]
        if adapter is None:
            raise AdapterError(f"this config has several adapters: say which with --adapter ({', '.join(names)})")
        night = next((a.night for a in s.night_config().adapters if a.name == adapter), None)
        if night is None:
            raise AdapterError(f"--adapter {adapter}: no such [[adapters]] (they are: {', '.join(names)})")
        state_dir, hotswap = night.state_dir, night.hotswap
    paths = StatePaths(state_dir)
    if not read_only and not paths.ledger.exists() and not published_dirs(paths.root) and \
            not paths.current.is_symlink():  # a refusal creates no state directory
        raise AdapterError(f"nothing is published yet in {paths.root}: a first night (`nightshift once`, or the "
                           "service in its window) publishes the first version")
    return WithTargets(state_dir, hotswap=hotswap, cfg=getattr(s, "registry", None) or RegistryConfig(),
                       read_only=read_only,
                       price_per_gpu_hour=getattr(getattr(s, "gpu", None), "price_per_gpu_hour", None))


def _guarded(fn: Callable[[argparse.Namespace, WithTargets], int], *,
             read_only: bool = False) -> Callable[[argparse.Namespace, Any], int]:
    """(args, Adapters) -> the CLI's (args, settings) handler. Operator errors become one clear
    line on stderr and exit 1; the one in service stays. `read_only`: the command creates nothing."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace, s: Any) -> int:
        try:
            ad = open_adapters(s, read_only=read_only, adapter=getattr(args, "adapter", None))
        except AdapterError as e:
            print(f"refused: {e}", file=sys.stderr)
            return ExitCode.FAILED
        try:
            return int(fn(args, ad))
        except IntegrityError as e:
            cur = ad.registry.current()
            print(f"refused: {e}; {cur.name if cur else 'nothing'} stays in service", file=sys.stderr)
        except LockTimeout as e:
            print(f"busy: {e}; nothing changed", file=sys.stderr)
            return ExitCode.BUSY
        except AdapterError as e:
            print(f"refused: {e}", file=sys.stderr)
        finally:
            ad.close()
        return ExitCode.FAILED

    return run


def _reading(fn: Callable[[argparse.Namespace, WithTargets], int]) -> Callable[[argparse.Namespace, Any], int]:
    return _guarded(fn, read_only=True)


# ---- reading ------------------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    return "—" if ts is None else dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M")


def _size(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _fig(x: Any) -> str:
    return "—" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def _token_accuracy(metrics: dict[str, Any]) -> float | None:
    """Reply token accuracy; manifests written before it have next-token "accuracy"."""
    return metrics.get("token_accuracy", metrics.get("accuracy"))


def _row(i: VersionInfo) -> dict[str, Any]:
    m = i.manifest
    gate = m.get("gate") or {}
    losses = m.get("losses") or {}
    return {
        "version": i.version,
        "name": i.name,
        "status": i.status,
        "missing": i.missing,
        "method": i.method,
        "size_bytes": i.size_bytes,
        "in_service": i.in_service,
        "pinned": i.pinned,
        "gate": None if not gate else ("passed" if gate.get("passed") else "failed"),
        "heldout_loss": losses.get("heldout_after"),
        "regression_loss": losses.get("regression_after"),
        "heldout_accuracy": _token_accuracy((m.get("metrics") or {}).get("heldout_after") or {}),
        "samples": (m.get("data") or {}).get("samples"),
        "parent": i.parent,
        "created_at": i.created_at,
        "promoted_at": i.promoted_at,
        "path": str(i.path) if i.on_disk else None,
    }


@_reading
def cmd_list(args: argparse.Namespace, ad: Adapters) -> int:
    rows = [_row(i) for i in ad.versions()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no versions yet")
        return 0
    head = ("", "VERSION", "STATUS", "METHOD", "SIZE", "GATE", "HELDOUT", "REGRESSION", "HELD-ACC", "SAMPLES",
            "CREATED", "LAST PROMOTED", "PIN")
    print(grid(head, [
        ("*" if r["in_service"] else "", r["name"], r["status"] + (", MISSING" if r["missing"] else ""), r["method"],
         _size(r["size_bytes"]),
         r["gate"] or "—", _fig(r["heldout_loss"]),
         _fig(r["regression_loss"]), _fig(r["heldout_accuracy"]), _fig(r["samples"]), _when(r["created_at"]),
         _when(r["promoted_at"]), "pinned" if r["pinned"] else "")
        for r in rows]))
    print("\n* in service (the `current` link); HELDOUT/REGRESSION: loss after training; HELD-ACC: reply tokens right")
    if any(r["missing"] for r in rows):
        print("MISSING: the ledger keeps it but its directory is gone (not pruned): restore it from a backup; "
              "`nightshift doctor` lists what is missing")
    return 0


@_reading
def cmd_show(args: argparse.Namespace, ad: Adapters) -> int:
    i = ad.get(args.version)
    if args.json:
        print(json.dumps(i.manifest, indent=2, sort_keys=True, default=str))
        return 0
    state = [i.status] + (["IN SERVICE"] if i.in_service else []) + (["pinned"] if i.pinned else [])
    kind = "a LoRA adapter" if i.method != "full" else "a whole model"
    where = (str(i.path) if i.on_disk else f"files MISSING from {i.path} (not pruned): restore them from a backup"
             if i.missing else "files deleted (pruned)")
    print(show_lines(i.name, f"{', '.join(state)}; {i.method} ({kind}, {_size(i.size_bytes)}); {where}", i.manifest,
                     extra=[("per million tokens", _cost(ad, i.manifest))]))
    return 0


def _cost(ad: WithTargets, manifest: dict[str, Any]) -> str:
    """What a million of the version's tokens cost, from its night's summary in the ledger (jobs/gpu/cost.py)."""
    row = ad.ledger.run(str(manifest.get("run_id") or ""))
    try:
        summary = RunSummary.model_validate_json(row["summary"]) if row is not None and row["summary"] else None
    except ValidationError:  # a summary an older version wrote: the figures stay in --json
        summary = None
    return (summary_cost(summary, ad.price_per_gpu_hour).line() if summary else None) or "—"


@_reading
def cmd_diff(args: argparse.Namespace, ad: Adapters) -> int:
    a, b = ad.get(args.a), ad.get(args.b)
    rows = diff(a.manifest, b.manifest)
    if args.json:
        print(json.dumps([{"key": k, a.name: va, b.name: vb} for k, va, vb in rows], indent=2, default=str))
        return 0
    print(diff_lines(a.name, b.name, rows))
    return 0


# ---- changing what is in service ----------------------------------------------------------------


def _report(ad: WithTargets, outcomes: list[HotswapOutcome] | None) -> int:
    if outcomes is None:
        print("  hot-swap: skipped, `current` moved on meanwhile (whoever moved it announces)")
        return 0
    _print_outcomes(outcomes, ad.hotswap_cfg)
    if any(not o.ok for o in outcomes):
        print(f"  the move stands: {_vname(ad, ad.registry.current_version())} is in service here; "
              "`nightshift hotswap` re-sends it once the server is up", file=sys.stderr)
        return ExitCode.HOTSWAP_FAILED
    return 0


def _print_outcomes(outcomes: list[HotswapOutcome], cfg: HotswapConfig) -> None:
    if not cfg.targets:
        print("  hot-swap: no [hotswap] targets configured")
    for o in outcomes:
        line = f"  hot-swap {o.target} ({o.kind}): " + ("ok" if o.ok else f"FAILED: {redact_text(str(o.error))}")
        print(line + f" [{o.attempts} attempt(s), {o.seconds:.1f} s]", file=sys.stdout if o.ok else sys.stderr)
    if cfg.newest_name_file is not None:
        print(f"  newest name file: {cfg.newest_name_file}")


@_guarded
def cmd_promote(args: argparse.Namespace, ad: WithTargets) -> int:
    info, previous = ad.promote(args.version)
    print(f"{info.name} is in service (was {_vname(ad, previous)}); integrity verified", flush=True)
    return _report(ad, versions.send(ad, ad.hotswap_cfg, info.version, trigger="promote", only_if_current=True)[1])


@_guarded
def cmd_rollback(args: argparse.Namespace, ad: WithTargets) -> int:
    info, previous = ad.rollback()
    print(f"rolled back: {info.name} is in service (was {_vname(ad, previous)}); integrity verified", flush=True)
    return _report(ad, versions.send(ad, ad.hotswap_cfg, info.version, trigger="rollback", only_if_current=True)[1])


def _vname(ad: Adapters, v: int | None) -> str:
    if v is None:
        return "nothing"
    row = ad.ledger.version(v)
    return row["name"] if row is not None else f"v{v:04d}"


@_guarded
def cmd_pin(args: argparse.Namespace, ad: Adapters) -> int:
    print(f"{ad.set_pinned(args.version, True).name} pinned: prune keeps it")
    return 0


@_guarded
def cmd_unpin(args: argparse.Namespace, ad: Adapters) -> int:
    print(f"{ad.set_pinned(args.version, False).name} unpinned")
    return 0


@_guarded
def cmd_prune(args: argparse.Namespace, ad: Adapters) -> int:
    res = ad.prune(dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb}: {', '.join(res.deleted) or 'nothing'}" + (f" ({_size(res.freed_bytes)})" if res.deleted else ""))
    for name, why in sorted(res.kept.items()):
        print(f"  kept {name}: {why}")
    for name in res.left_alone:
        print(f"  left alone {name}: being written or not in the ledger")
    return 0


@_guarded
def cmd_hotswap(args: argparse.Namespace, ad: WithTargets) -> int:
    info, outcomes = versions.send(ad, ad.hotswap_cfg, args.version, trigger="resend")
    outcomes = outcomes or []
    if args.json:
        print(
            json.dumps(
                {"version": info.version, "name": info.name,
                 "outcomes": [redact_value(o.model_dump(mode="json")) for o in outcomes]},
                indent=2,
                default=str,
            )
        )
    else:
        note = "" if info.in_service else " (NOT the version in service)"
        failed = [o.target for o in outcomes if not o.ok]
        print(f"{'tried to send' if failed else 'sent'} {info.name}{note}; integrity verified")
        _print_outcomes(outcomes, ad.hotswap_cfg)
        if failed:
            print(f"  not taken by {', '.join(failed)}; {_vname(ad, ad.registry.current_version())} stays in service "
                  "here: run `nightshift hotswap` again once the server is up", file=sys.stderr)
    return ExitCode.HOTSWAP_FAILED if any(not o.ok for o in outcomes) else 0
