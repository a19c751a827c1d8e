"""Runs left open by the end of their window: closed before any later night plans.

A run is resumed only within its own window (its stored deadline is the last attempt's: the end of
the window it ran in, less the save margin). Once that has passed, the run is closed as failed: the
version number it reserved is given back, its checkpoints are dropped, and its samples — never marked
trained, since only a publish does that — are pending again, so the next night plans from the ledger
as it is then instead of retraining an old plan.
"""

from __future__ import annotations

import sqlite3
import time

import structlog

from jobs.store.cleanup import close_run
from jobs.store.ledger import Ledger

log = structlog.get_logger("nightshift.store")


def open_runs(ledger: Ledger) -> list[sqlite3.Row]:
    return ledger.db.execute("SELECT * FROM runs WHERE status='running' ORDER BY started_at").fetchall()


def expired(run: sqlite3.Row, now: float) -> bool:
    return run["deadline"] is not None and now >= float(run["deadline"])


def close_expired_runs(ledger: Ledger, now: float) -> list[str]:
    """Close every open run whose window has ended (the caller holds the night lock); returns their ids."""
    closed = []
    for run in open_runs(ledger):
        if not expired(run, now):
            continue
        why = (f"its window ended ({_when(run['deadline'])}) before it finished; its samples are pending again "
               "and a later night plans them afresh")
        close_run(ledger, str(run["id"]), "failed", error=why)
        ledger.add_event("run_expired", run_id=str(run["id"]), detail={"night": run["night"], "why": why})
        log.warning("open_run_closed", run_id=str(run["id"]), night=run["night"], why=why)
        closed.append(str(run["id"]))
    return closed


def fate(run: sqlite3.Row, now: float, *, night_running: bool) -> str:
    """What happens to an open run, in words (for `doctor` and `status`)."""
    head = f"run {run['id']} of night {run['night']} is open (attempt {run['attempt']})"
    if night_running:
        return f"{head}: a night is running now and owns it"
    if expired(run, now):
        return (f"{head} and its window ended {_when(run['deadline'])}: the next night closes it as failed and "
                "its samples go back to pending (nothing it trained was published)")
    return f"{head}: a start before {_when(run['deadline'])} resumes it from its last checkpoint"


def _when(ts: float | None) -> str:
    return "at an unknown time" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
