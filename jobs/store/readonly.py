"""The ledger opened for reading only: `nightshift plan`, `validate` and `report` change nothing."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from jobs.store.files import DamagedState, permission_problem, writable
from jobs.store.ledger import Ledger
from jobs.store.schema import LATEST, migrate, schema_version


def read_only_uri(path: Path) -> str:
    """The URI that reads a ledger without changing its directory. No -wal beside it: no writer has it open and
    every commit is in the file itself; `immutable` then reads it without creating the -wal/-shm companions a plain
    read-only open leaves behind (a status must not change the state directory). With a -wal (a night running),
    read through it."""
    wal = path.with_name(path.name + "-wal")
    return f"{path.resolve().as_uri()}?mode=ro" + ("" if wal.exists() else "&immutable=1")


def open_read_only(path: Path, *, clock=time.time) -> Ledger:
    """A Ledger whose every write raises sqlite3.OperationalError. A ledger that does not exist yet
    reads as an empty one and nothing is created; one of an older schema is read through a migrated
    copy in memory (the file is migrated by the next night, never here). Nothing is created beside it."""
    ledger = Ledger.__new__(Ledger)
    ledger.path, ledger.clock = Path(path), clock
    if ledger.path.is_file():
        if not os.access(ledger.path, os.R_OK):  # asked, not opened: closing a descriptor drops SQLite's locks
            raise permission_problem(ledger.path, None, write=False)
        db = None
        try:
            db = _connect(ledger.path)
            if schema_version(db) < LATEST:
                copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
                db.backup(copy)
                db.close()
                db = copy
                migrate(db, ledger.path)
                db.execute("PRAGMA query_only=ON")
        except sqlite3.DatabaseError as e:
            if db is not None:
                db.close()
            if isinstance(e, sqlite3.OperationalError) and not writable(ledger.path.parent):
                raise permission_problem(ledger.path.parent, None, write=False) from None
            raise DamagedState(f"{ledger.path} is not a readable nightshift ledger ({e}): restore it from a "
                               "backup; `nightshift doctor` lists what it finds") from None
    else:
        db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        migrate(db, ledger.path)
        db.execute("PRAGMA query_only=ON")
    db.row_factory = sqlite3.Row
    ledger.db = db
    return ledger


def _connect(path: Path) -> sqlite3.Connection:
    """`read_only_uri`; where the directory cannot be written (a read-only state directory, another user's),
    SQLite cannot make the WAL's shared-memory file, so the file is read as it is on disk (immutable)."""
    uri = read_only_uri(path)
    db = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
    try:
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        db.close()
        if writable(path.parent):
            raise
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, timeout=30, isolation_level=None,
                           check_same_thread=False)
