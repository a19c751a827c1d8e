"""The ledger's schema and its migrations, and opening it safely.

The schema version is SQLite's `PRAGMA user_version`. A ledger is brought up to date when it is
opened, inside one transaction per step, so a crash mid-migration leaves the previous version whole.

**Adding a migration** (a column, a table, an index, a new status): append one `Step` to
`MIGRATIONS` with the next number and never edit a released step. A step runs once per ledger, in
order, inside a transaction; SQLite's `ALTER TABLE ... ADD COLUMN` is the usual tool. `SCHEMA` below
is version 1 as it was released: do not change it either.

Opening refuses what would otherwise be taken for a fresh start: a ledger that is missing, empty or
not SQLite while the registry holds published versions, and a ledger written by a newer nightshift.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobs.contract import parse_version_name
from jobs.store import learning_schema
from jobs.store.files import (
    PRIVATE_FILE,
    SHARED_DIR,
    DamagedState,
    chmod_quietly,
    make_dir,
    permission_problem,
    writable,
)
from jobs.store.paths import StatePaths

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  id INTEGER PRIMARY KEY, source TEXT NOT NULL, path TEXT NOT NULL, size INTEGER NOT NULL,
  mtime REAL NOT NULL, sha256 TEXT NOT NULL, seen_at REAL NOT NULL, run_id TEXT,
  records INTEGER DEFAULT 0, accepted INTEGER DEFAULT 0, duplicates INTEGER DEFAULT 0,
  quarantined INTEGER DEFAULT 0, moved_to TEXT, UNIQUE (source, sha256));
CREATE INDEX IF NOT EXISTS files_by_path ON files (source, path, size, mtime);
CREATE TABLE IF NOT EXISTS samples (
  id INTEGER PRIMARY KEY AUTOINCREMENT, hash TEXT NOT NULL UNIQUE, source TEXT NOT NULL,
  file_id INTEGER, line INTEGER, record TEXT NOT NULL, n_tokens INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'trained', 'heldout')), version INTEGER,
  created_at REAL NOT NULL, trained_at REAL);
CREATE INDEX IF NOT EXISTS samples_by_status ON samples (status, id);
CREATE TABLE IF NOT EXISTS quarantine (
  id INTEGER PRIMARY KEY, run_id TEXT, source TEXT, file TEXT, line INTEGER, reason TEXT NOT NULL,
  detail TEXT, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, night TEXT NOT NULL, status TEXT NOT NULL, started_at REAL NOT NULL,
  ended_at REAL, deadline REAL, attempt INTEGER NOT NULL DEFAULT 1, version INTEGER, plan TEXT,
  summary TEXT, error TEXT);
CREATE INDEX IF NOT EXISTS runs_by_night ON runs (night, started_at);
CREATE TABLE IF NOT EXISTS run_samples (
  run_id TEXT NOT NULL, ord INTEGER NOT NULL, sample_id INTEGER NOT NULL, role TEXT NOT NULL,
  PRIMARY KEY (run_id, ord));
CREATE TABLE IF NOT EXISTS phases (
  run_id TEXT NOT NULL, phase TEXT NOT NULL, started_at REAL NOT NULL, seconds REAL,
  PRIMARY KEY (run_id, phase, started_at));
CREATE TABLE IF NOT EXISTS throughput (
  id INTEGER PRIMARY KEY, key TEXT NOT NULL, run_id TEXT, at REAL NOT NULL, origin TEXT NOT NULL,
  tokens INTEGER NOT NULL, seconds REAL NOT NULL, tokens_per_second REAL NOT NULL,
  overhead_seconds REAL, detail TEXT);
CREATE INDEX IF NOT EXISTS throughput_by_key ON throughput (key, at);
CREATE TABLE IF NOT EXISTS versions (
  version INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, run_id TEXT, parent INTEGER, path TEXT,
  status TEXT NOT NULL, created_at REAL NOT NULL, promoted_at REAL, manifest TEXT);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, kind TEXT NOT NULL, run_id TEXT, version INTEGER,
  detail TEXT);
CREATE TABLE IF NOT EXISTS promotions (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, version INTEGER NOT NULL, action TEXT NOT NULL,
  from_version INTEGER, run_id TEXT);
CREATE TABLE IF NOT EXISTS pins (version INTEGER PRIMARY KEY, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS hotswaps (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, version INTEGER NOT NULL, trigger TEXT NOT NULL, run_id TEXT,
  target TEXT NOT NULL, kind TEXT NOT NULL, ok INTEGER NOT NULL, attempts INTEGER, seconds REAL, error TEXT,
  detail TEXT);
CREATE INDEX IF NOT EXISTS hotswaps_by_version ON hotswaps (version, at);
"""


@dataclass(frozen=True)
class Step:
    version: int  # the schema version this step produces
    why: str
    apply: Callable[[sqlite3.Connection], None]


def _baseline(c: sqlite3.Connection) -> None:
    for statement in SCHEMA.split(";"):  # IF NOT EXISTS throughout: adopts a pre-versioning ledger
        if statement.strip():
            c.execute(statement)


def _file_identity(c: sqlite3.Connection) -> None:
    c.execute("ALTER TABLE files ADD COLUMN stat_key TEXT")
    c.execute("CREATE INDEX IF NOT EXISTS files_by_stat ON files (source, path, stat_key)")


MIGRATIONS: list[Step] = [
    Step(1, "baseline schema", _baseline),
    Step(2, "files: identity is the content hash; a stat key with inode and ctime only skips re-hashing",
         _file_identity),
    Step(3, "learning that holds: sample statuses rejected/set_aside, regression set, loss curves, references",
         learning_schema.migrate),
    Step(4, "file strikes: a rejected night's blamed files held, quarantined at the second fault (issue 39)",
         learning_schema.migrate_file_strikes),
]
LATEST = MIGRATIONS[-1].version


def published_dirs(state_dir: Path) -> list[str]:
    """Names of version directories in the registry (`<name>-vNNNN`), whoever's they are."""
    adapters = StatePaths(state_dir).adapters
    try:
        return sorted(p.name for p in adapters.iterdir() if parse_version_name(p.name) and p.is_dir())
    except OSError:
        return []


def open_database(path: Path, *, timeout: float = 30.0) -> sqlite3.Connection:
    """Connect (creating a private file when there is none), check it is ours, migrate it."""
    path = Path(path)
    state = path.parent
    versions = published_dirs(state)
    has_current = StatePaths(state).current.is_symlink() or StatePaths(state).current.exists()
    size = path.stat().st_size if path.exists() else None
    if not size and (versions or has_current):
        what = "missing" if size is None else "empty (0 bytes)"
        raise DamagedState(
            f"{path} is {what}, but {StatePaths(state).adapters} holds {len(versions)} published version(s)"
            + (" and `current` is set" if has_current else "")
            + ": refusing to start afresh (every sample would be trained again and version names reused). "
            "Restore the ledger from a backup, or move the whole state directory aside to start over; "
            "`nightshift doctor` lists what it finds")
    try:
        if size is None:
            if not state.exists():
                make_dir(state, SHARED_DIR)  # the inference server's group traverses it to the versions
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE))  # WAL and SHM inherit it
        elif not os.access(path, os.R_OK | os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        # An existing ledger is asked (access), never opened and closed here: closing any descriptor of the file
        # drops every POSIX lock this process holds on it, SQLite's included (another connection of this process,
        # e.g. the service's, would then read pages a night is rewriting: "database disk image is malformed").
    except PermissionError as e:
        raise permission_problem(path, e) from None
    except OSError as e:
        if e.errno == errno.EROFS:  # a read-only file system: a permission too
            raise permission_problem(path, e) from None
        raise
    chmod_quietly(path, PRIVATE_FILE)
    db = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a committed 'trained' must survive power loss
        db.execute("PRAGMA foreign_keys=ON")
        migrate(db, path, has_versions=bool(versions))
    except sqlite3.DatabaseError as e:
        db.close()
        if isinstance(e, sqlite3.OperationalError) and not writable(state):  # its -wal/-shm cannot be made
            raise permission_problem(state, None) from None
        raise DamagedState(f"{path} is not a readable nightshift ledger ({e}): restore it from a backup; "
                           "`nightshift doctor` lists what it finds") from None
    except BaseException:
        db.close()
        raise
    return db


def schema_version(db: sqlite3.Connection) -> int:
    """The ledger's schema version (0: a new file, or a ledger from before versioning)."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: sqlite3.Connection, path: Path, *, has_versions: bool = False) -> int:
    """Bring the ledger to LATEST, one transaction per step; returns the version found. Step 1 creates
    the baseline tables only where missing, so it also adopts a ledger from before versioning."""
    found = schema_version(db)
    if found > LATEST:
        raise DamagedState(f"{path} has schema version {found}, newer than this nightshift knows ({LATEST}): "
                           "it was written by a newer release; upgrade nightshift (do not downgrade a ledger)")
    has_tables = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='runs'").fetchone()
    if found == 0 and not has_tables and has_versions:
        raise DamagedState(f"{path} holds no ledger tables, but the registry holds published versions: "
                           "refusing to start afresh; restore the ledger from a backup")
    for step in MIGRATIONS:
        if step.version <= found:
            continue
        db.execute("BEGIN IMMEDIATE")
        try:
            if schema_version(db) < step.version:  # another process may have migrated meanwhile
                step.apply(db)
                db.execute(f"PRAGMA user_version={int(step.version)}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    return found
