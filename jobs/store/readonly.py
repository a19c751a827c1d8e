"""The ledger opened for reading only: `nightshift plan`, `validate` and `report` change nothing."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from jobs.store.ledger import SCHEMA, Ledger


def open_read_only(path: Path, *, clock=time.time) -> Ledger:
    """A Ledger whose every write raises sqlite3.OperationalError. A ledger that does not exist yet
    reads as an empty one and nothing is created (next to an existing one, SQLite may leave its
    -wal/-shm companions: they are not data)."""
    ledger = Ledger.__new__(Ledger)
    ledger.path, ledger.clock = Path(path), clock
    if ledger.path.is_file():
        uri = f"{ledger.path.resolve().as_uri()}?mode=ro"
        ledger.db = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
    else:
        ledger.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        ledger.db.executescript(SCHEMA)
    ledger.db.row_factory = sqlite3.Row
    return ledger
