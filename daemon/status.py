"""`nightshift status`: what an operator asks first, read from the ledger (no torch)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon.settings import Settings
from daemon.tables import grid, key_values
from jobs.store import learning
from jobs.store.locking import night_running
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from jobs.store.registry import Registry
from jobs.store.stale import fate


def collect(s: Settings, now: datetime | None = None) -> dict[str, Any]:
    now = now or datetime.now(UTC)
    zone = s.window.zone()
    w = s.window.window_at(now)
    nxt, done = s.window.next_window(now), None
    ledger = open_read_only(StatePaths(s.state_dir).ledger)
    try:  # a window whose night already ran (the window moved later the same day) is not run again: the next is
        if ledger.night_done(nxt.night):
            done, nxt = nxt, s.window.next_window(nxt.start)
    finally:
        ledger.close()
    info = {
        "window": s.window.describe(),
        "window_open": w is not None,
        "next_window_start": nxt.start.astimezone(zone).isoformat(timespec="minutes"),
        **({"skipped_window": {"start": done.start.astimezone(zone).isoformat(timespec="minutes"),
                               "night": done.night}} if done else {}),
        **_state(Path(s.state_dir), zone, w.night if w else None),
    }
    targets = {t.name for t in s.hotswap.targets}  # a server taken out of the config is no longer asked
    if s.adapters:  # [[adapters]]: each adapter's own state directory (the top one holds the night's own runs)
        info["adapters"] = {a.name: _state(StatePaths(s.state_dir).adapter(a.name).root, zone, w.night if w else None)
                            for a in s.adapters}
    for place in [info, *(info.get("adapters") or {}).values()]:
        if place["in_service"]:
            place["in_service"]["hotswap"] = {k: v for k, v in place["in_service"]["hotswap"].items() if k in targets}
    return info


def _state(state_dir: Path, zone: Any, night: str | None) -> dict[str, Any]:
    """What one state directory's ledger and registry say."""
    ledger = open_read_only(StatePaths(state_dir).ledger)  # creates nothing, migrates nothing; read-only works
    running = night_running(state_dir)
    try:
        runs = []
        for r in ledger.last_runs(10):
            summ = json.loads(r["summary"]) if r["summary"] else {}
            # an open run no night holds was stopped (Ctrl-C, SIGTERM, a crash): said so, with what comes of it
            stopped = r["status"] == "running" and not running
            runs.append({
                "run_id": r["id"], "night": r["night"], "status": "stopped" if stopped else r["status"],
                "version": r["version"],
                "started": datetime.fromtimestamp(r["started_at"], zone).isoformat(timespec="seconds"),
                "seconds": round(r["ended_at"] - r["started_at"], 1) if r["ended_at"] else None,
                "trained_samples": summ.get("trained_samples"), "attempts": r["attempt"],
                "error": fate(r, time.time(), night_running=False).split(": ", 1)[1] if stopped else r["error"],
            })
        backlog = ledger.backlog()
        current = Registry(state_dir, create=False).current_version()
        row = ledger.version(current) if current else None
        manifest = json.loads(row["manifest"]) if row and row["manifest"] else {}
        aside = learning.set_aside(ledger)
        regression = learning.regression_size(ledger)
        return {
            "learning": {"set_aside": aside["samples"], "set_aside_reasons": aside["reasons"],
                         "ever_rejected": aside["ever_rejected"],
                         "reference_version": learning.reference_version(ledger),
                         "regression_samples": regression[0], "regression_slices": regression[1]},
            "tonight_done": ledger.night_done(night) if night else None,
            "runs": runs,
            "backlog": {"samples": backlog[0], "tokens": backlog[1]},
            "samples": ledger.sample_counts(),
            "in_service": None if row is None else {
                "version": current, "name": row["name"], "path": row["path"],
                "promoted": datetime.fromtimestamp(row["promoted_at"], zone).isoformat(timespec="seconds")
                if row["promoted_at"] else None,
                "base_model": manifest.get("base_model", {}).get("path"),
                "method": manifest.get("method") or "qlora",
                "hotswap": _last_sends(ledger, current, zone),
            },
        }
    finally:
        ledger.close()


def _last_sends(ledger: Any, version: int | None, zone: Any) -> dict[str, dict[str, Any]]:
    """Each inference server's last answer to the version in service (a night, promote, rollback, hotswap)."""
    last = {r["target"]: r for r in ledger.hotswaps(version)} if version else {}
    return {t: {"ok": bool(r["ok"]), "at": datetime.fromtimestamp(r["at"], zone).isoformat(timespec="seconds"),
                "error": r["error"]} for t, r in last.items()}


def _sends_line(svc: dict[str, Any] | None) -> list[tuple[str, str]]:
    sends = (svc or {}).get("hotswap") or {}
    if not sends:
        return []
    text = ", ".join(f"{t} ok" if x["ok"] else f"{t} did NOT take it ({x['at']}: {x['error']})"
                     for t, x in sends.items())
    if not all(x["ok"] for x in sends.values()):
        text += "; `nightshift hotswap` re-sends it once the server is up (the service does at its start)"
    return [("inference servers", text)]


def _adapters(info: dict[str, Any]) -> str:
    """[[adapters]]: one row per adapter: its version in service and how its last night ended."""
    rows = []
    for name, a in info.items():
        last = a["runs"][0] if a["runs"] else None
        svc = a["in_service"]
        unheard = [t for t, x in ((svc or {}).get("hotswap") or {}).items() if not x["ok"]]
        rows.append([name, svc["name"] if svc else "none yet", last["night"] if last else "—",
                     last["status"] if last else "—", (last or {}).get("version") or "—",
                     f"{a['backlog']['samples']:,} / {a['backlog']['tokens']:,}",
                     ((last or {}).get("error") or "")[:50] + "".join(f" not taken by {t} (`nightshift hotswap "
                                                                      f"--adapter {name}`)" for t in unheard)])
    return "adapters:\n" + grid(("adapter", "in service", "last night", "last outcome", "last version",
                                  "backlog samples / tokens", "error"), rows)


def _learning(info: dict[str, Any]) -> list[tuple[str, str]]:
    """The regression set, the gate's reference, and the samples rejected nights gave back or set aside."""
    if not info:
        return []
    ref = info["reference_version"]
    out = [("regression set", f"{info['regression_samples']:,} samples from {info['regression_slices']:,} "
                              "night/source slices"),
           ("gate reference", f"v{ref:04d} (best promoted so far)" if ref else "the base model (none promoted yet)"),
           ("rejected nights", f"{info['ever_rejected']:,} samples were in one; {info['set_aside']:,} set aside")]
    out += [("  set aside", f"{n:,}: {why}") for why, n in sorted(info["set_aside_reasons"].items())][:5]
    return out


def render(info: dict[str, Any]) -> str:
    svc = info["in_service"]
    head = key_values([
        *([("config", info["config"])] if info.get("config") else []),
        ("window", info["window"] + (" (open now" + ("; its night is done" if info.get("tonight_done") else "")
                                     + ")" if info["window_open"] else "")),
        ("next window", info["next_window_start"] + (
            f" ({info['skipped_window']['start']} is not run: its night {info['skipped_window']['night']} is done "
            "already, one night per date)" if info.get("skipped_window") else "")),
        ("adapter in service", "one per adapter (below)" if info.get("adapters") else
         f"{svc['name']} ({svc['method']}, promoted {svc['promoted']})" if svc else "none yet"),
        *_sends_line(svc),
        ("backlog", f"{info['backlog']['samples']:,} samples, {info['backlog']['tokens']:,} tokens"),
        ("samples", ", ".join(f"{k} {v:,}" for k, v in sorted(info["samples"].items())) or "none"),
        *_learning(info.get("learning") or {}),
    ])
    cols = ("night", "status", "version", "trained_samples", "seconds", "started", "error")
    rows = [[r[c] for c in cols] for r in info["runs"]]
    several = _adapters(info["adapters"]) + "\n\n" if info.get("adapters") else ""
    return head + "\n\n" + several + "last runs:\n" + (grid(cols, rows) if rows else "  none yet")
