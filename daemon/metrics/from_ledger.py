"""The service's series from the ledgers at start and after each night: each adapter's backlog, version in
service and last run, so a restart blanks no dashboard ([[adapters]]: one set of series per adapter)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from daemon.metrics.night import NightshiftMetrics
from daemon.report_data import adapter_states
from daemon.settings import Settings
from jobs.contract import Outcome
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from jobs.store.registry import Registry


@contextmanager
def adapter_ledgers(settings: Settings, own: Ledger) -> Iterator[list[tuple[str, StatePaths, Ledger]]]:
    """Every adapter's (name, state directory, ledger): the service's own ledger `own` in a config of one
    adapter; each named adapter's own, read-only, where it exists (one never trained has no series yet)."""
    opened: list[Ledger] = []
    found: list[tuple[str, StatePaths, Ledger]] = []
    try:
        for name, paths in adapter_states(settings):
            if not name:
                found.append((name, paths, own))
            elif paths.ledger.is_file():
                opened.append(open_read_only(paths.ledger))
                found.append((name, paths, opened[-1]))
        yield found
    finally:
        for led in opened:
            led.close()


def refresh_from_ledgers(metrics: NightshiftMetrics, settings: Settings, own: Ledger) -> None:
    """Backlog and the version in service of each adapter."""
    with adapter_ledgers(settings, own) as adapters:
        for name, paths, ledger in adapters:
            metrics.set_backlog(*ledger.backlog(), adapter=name)
            version = Registry(paths.root).current_version()
            row = ledger.version(version) if version else None
            if row is not None:
                manifest = json.loads(row["manifest"] or "{}")
                metrics.set_adapter_in_service(version, row["name"], manifest.get("base_model", {}).get("path", ""),
                                               manifest.get("method") or "qlora", adapter=name)


def restore_from_ledgers(metrics: NightshiftMetrics, settings: Settings, own: Ledger) -> None:
    """Each adapter's last run (its typed summary; the row is the truth on how it ended), then the backlog."""
    with adapter_ledgers(settings, own) as adapters:
        for name, _, ledger in adapters:
            runs = ledger.last_runs(50)
            finished = sorted((r for r in runs if r["ended_at"]), key=lambda r: r["ended_at"], reverse=True)
            success = next((r["ended_at"] for r in finished if r["status"] == "succeeded"), None)
            last = finished[0] if finished else None
            summary = ledger.summary_of(last) if last is not None else None
            if summary is not None:  # the daemon may have closed the run: the row says how it ended
                summary = summary.model_copy(update={"outcome": Outcome(last["status"]), "ended_at": last["ended_at"]})
                end = summary.deadline + settings.window.save_margin.total_seconds() if summary.deadline else None
                metrics.restore_last_run(summary, window_end=end, adapter=name)
            metrics.restore(last_success=success, last_run=last["ended_at"] if last else None,
                            last_outcome=last["status"] if last else None, adapter=name)
    refresh_from_ledgers(metrics, settings, own)
