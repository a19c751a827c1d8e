"""Closing a run releases what it held: the checkpoints kept for its resume and the version number it
reserved but never published (a failed or skipped night gives its number back, so failed attempts
burn no names: a name is burned only once something was published under it).

Callers hold the night lock (the night's child, or its supervisor closing a night it gave up on).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import structlog

from jobs.contract import RunSummary
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths

log = structlog.get_logger("nightshift.store")
TMP_PREFIX = ".tmp-"  # the registry's prefix for directories nothing serves (cleaned at the next publish)


def checkpoints_dir(state_dir: Path, run_id: str) -> Path:
    return StatePaths(state_dir).run_checkpoints(run_id)


def close_run(ledger: Ledger, run_id: str, status: str, *, summary: RunSummary | None = None,
              error: str | None = None) -> None:
    """Close a run in the ledger, then drop its checkpoints and any unpublished directory of its version.

    The unpublished directory (a publish killed between its rename and the ledger's commit) is moved
    aside before the ledger lets its number go, so a crash in between never leaves a directory under
    a number the ledger has released."""
    state = ledger.path.parent
    aside: list[Path] = []
    if status in ("failed", "skipped"):
        rows = ledger.db.execute("SELECT name FROM versions WHERE run_id=? AND status='training'", (run_id,))
        for r in rows.fetchall():
            d = StatePaths(state).adapters / r["name"]
            if d.is_dir() and not d.is_symlink():
                hole = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}released-{r['name']}-", dir=d.parent))
                os.rename(d, hole / r["name"])
                aside.append(hole)
    ledger.finish_run(run_id, status, summary=summary, error=error)
    for hole in aside:
        shutil.rmtree(hole, ignore_errors=True)
    shutil.rmtree(checkpoints_dir(state, run_id), ignore_errors=True)


def sweep_checkpoints(ledger: Ledger) -> list[str]:
    """Remove the checkpoints of every run that is no longer open (closed by anyone, or unknown)."""
    root = StatePaths(ledger.path.parent).checkpoints
    if not root.is_dir():
        return []
    running = {str(r[0]) for r in ledger.db.execute("SELECT id FROM runs WHERE status='running'")}
    gone = [p.name for p in root.iterdir() if p.name not in running]
    for name in gone:
        shutil.rmtree(root / name, ignore_errors=True)
    if gone:
        log.info("checkpoints_removed", runs=gone, why="their runs are closed")
    return gone
