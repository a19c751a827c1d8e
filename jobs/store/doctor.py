"""`nightshift doctor`: the ledger, the registry and `current` checked against each other, read-only.

Every finding says what is wrong and how to repair it. Nothing is changed here: the ledger is opened
read-only (not even migrated), and the registry lock is taken only to read a consistent picture.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jobs.contract import parse_version_name
from jobs.store.integrity import ledger_in_service, unknown_versions
from jobs.store.ledger import Ledger
from jobs.store.locking import LockTimeout, StateLock, holder, night_running
from jobs.store.paths import StatePaths
from jobs.store.readonly import read_only_uri
from jobs.store.registry import TMP_PREFIX, IntegrityError, Registry
from jobs.store.schema import LATEST, published_dirs, schema_version
from jobs.store.stale import fate, open_runs


@dataclass(frozen=True)
class Finding:
    level: str  # ok | note | problem
    subject: str
    text: str
    fix: str = ""


class _ReadOnlyLedger(Ledger):
    """The ledger opened with mode=ro: doctor never writes, creates or migrates."""

    def __init__(self, path: Path) -> None:  # no super().__init__: open_database would migrate
        self.path, self.clock = Path(path), None
        self.db = sqlite3.connect(read_only_uri(Path(path)), uri=True, isolation_level=None)
        self.db.row_factory = sqlite3.Row


def diagnose(state_dir: Path, *, name: str | None = None, lock_timeout: float = 30.0) -> list[Finding]:
    state = Path(state_dir)
    if not state.is_dir():
        return [Finding("ok", "state", f"{state} does not exist yet: nothing to check (a first night creates it)")]
    out: list[Finding] = []
    running = night_running(state)
    who = (holder(StatePaths(state).night_lock) or "its holder did not say who") if running else ""
    out.append(Finding("note", "night", f"a night is running ({who})") if who else
               Finding("ok", "night", "no night is running"))
    try:
        if not StatePaths(state).lock.exists():  # nothing ever published or changed: no lock file to create
            return out + _check(state, name, running)
        with StateLock(StatePaths(state).lock, timeout=lock_timeout, what="doctor (reading)", shared=True):
            out += _check(state, name, running)
    except LockTimeout as e:
        out.append(Finding("problem", "lock", str(e), "run doctor again when the publish or command is done"))
    except PermissionError as e:  # a read-only state directory (a backup, another user's): read it unlocked
        out.append(Finding("note", "permissions", f"cannot take the registry lock ({e.strerror}: {e.filename}): "
                           "reading without it", "run doctor as the service's user to check under the lock"))
        out += _check(state, name, running)
    return out


def _check(state: Path, name: str | None, night_running: bool = False) -> list[Finding]:
    path = StatePaths(state).ledger
    dirs = published_dirs(state)
    registry = Registry(state, create=False)
    if not path.exists() or path.stat().st_size == 0:
        if dirs or registry.current_link.is_symlink():
            return [Finding("problem", "ledger", f"{path} is {'missing' if not path.exists() else 'empty'} but "
                            f"the registry holds {len(dirs)} version(s): every night is refused",
                            "restore the ledger from a backup; or, to start over, move the whole state directory "
                            "aside (the new numbering would start at v0001 again)")]
        return [Finding("ok", "ledger", "no ledger yet (a first night creates it)")]
    try:
        with open(path, "rb"):  # not readable by this user: a permission, never damage
            pass
    except PermissionError as e:
        return [Finding("problem", "permissions", f"{path} cannot be read by this user ({e.strerror}): the ledger "
                        "was not checked", "run doctor as the service's user (or with read access to the state "
                        "directory)")]
    try:
        ledger = _ReadOnlyLedger(path)
        check = ledger.db.execute("PRAGMA quick_check").fetchone()[0]
        version = schema_version(ledger.db)
    except sqlite3.DatabaseError as e:
        return [Finding("problem", "ledger", f"{path} is not a readable SQLite ledger ({e}): every command that "
                        "needs it is refused", "restore the ledger from a backup (with its -wal file if any)")]
    try:
        found = _against_registry(ledger, registry, check, version, name)
        return found + [Finding("note", "run", fate(r, time.time(), night_running=night_running))
                        for r in (open_runs(ledger) if _has_tables(ledger) else [])]
    except sqlite3.DatabaseError as e:
        return [Finding("problem", "ledger", f"{path} cannot be read ({e})", "restore the ledger from a backup")]
    finally:
        ledger.close()


def _against_registry(ledger: Ledger, registry: Registry, check: str, version: int,
                      name: str | None) -> list[Finding]:
    out: list[Finding] = []
    if check != "ok":
        out.append(Finding("problem", "ledger", f"SQLite integrity check failed: {check}",
                           "restore the ledger from a backup"))
    if version > LATEST:
        out.append(Finding("problem", "ledger", f"schema version {version} is newer than this nightshift "
                           f"({LATEST})", "upgrade nightshift"))
    elif version < LATEST:
        out.append(Finding("note", "ledger", f"schema version {version}: migrated to {LATEST} when next opened"))
    rows = ledger.versions() if version >= 1 or _has_tables(ledger) else []
    out.append(Finding("ok", "ledger", f"schema v{version}, {len(rows)} version(s), integrity {check}"))
    running = {str(r[0]) for r in ledger.db.execute("SELECT id FROM runs WHERE status='running'")} if rows or \
        _has_tables(ledger) else set()
    for r in rows:
        out += _version(registry, r, running)
    for d in unknown_versions(registry, ledger):
        ours = name is None or (parse_version_name(d) or ("",))[0] == name
        out.append(Finding("problem" if ours else "note", "registry", f"adapters/{d} is not in the ledger"
                           + (": the ledger is older than the registry; every night is refused" if ours else ""),
                           "restore the ledger that knows it, or move the directory out of adapters/"
                           if ours else ""))
    stale = sorted(p.name for p in registry.adapters.glob(f"{TMP_PREFIX}*")) if registry.adapters.is_dir() else []
    if stale:
        out.append(Finding("note", "registry", f"{len(stale)} unfinished write(s) ({', '.join(stale[:3])}): "
                           "removed at the next publish"))
    out += _current(registry, ledger)
    out += _leftovers(registry.state_dir, running)
    return out


def _has_tables(ledger: Ledger) -> bool:
    return ledger.db.execute("SELECT 1 FROM sqlite_master WHERE name='versions'").fetchone() is not None


def _version(registry: Registry, r: Any, running: set[str]) -> list[Finding]:
    path = registry.adapters / r["name"]
    if r["status"] in ("promoted", "rejected"):
        if not path.is_dir():
            return [Finding("problem", "registry", f"{r['name']} ({r['status']}) is missing from adapters/",
                            f"restore {path} from a backup (prune marks versions it deletes; this one was not)")]
        try:
            registry.verify(path)
        except (IntegrityError, OSError, ValueError) as e:
            return [Finding("problem", "registry", f"{r['name']}: {e}",
                            f"restore {path} from a backup; `nightshift adapters rollback` if it is in service")]
        if path.stat().st_mode & 0o050 != 0o050:
            return [Finding("note", "permissions", f"{r['name']} is not group-readable: the inference server's "
                            "group cannot read it", f"chmod -R g+rX {path}")]
    elif r["status"] == "training" and r["run_id"] not in running:
        return [Finding("note", "ledger", f"{r['name']} is marked 'training' but its run is closed",
                        "nothing to do: the number stays reserved")]
    elif r["status"] == "pruned" and path.exists():
        return [Finding("note", "registry", f"{r['name']} was pruned but its directory is still there",
                        "`nightshift adapters prune` removes it")]
    return []


def _current(registry: Registry, ledger: Ledger) -> list[Finding]:
    problem = registry.current_problem()
    expected = ledger_in_service(ledger) if _has_tables(ledger) else None
    current = registry.current_version()
    row = ledger.version(expected) if expected is not None else None
    want = row["name"] if row is not None else None
    fix = f"`nightshift adapters promote {want}` (or the next night restores it, if its files verify)" if want else ""
    if problem:
        return [Finding("problem", "current", problem + (f"; the ledger says {want} is in service" if want else ""),
                        fix or "remove the stale `current`: no version was ever put in service")]
    if current is None:
        if want:
            return [Finding("problem", "current", f"`current` is missing; the ledger says {want} is in service", fix)]
        return [Finding("ok", "current", "no version in service yet")]
    if current != expected or registry.current() != (registry.adapters / str(want)).resolve():
        return [Finding("problem", "current", f"`current` points at {registry.current()} but the ledger says "
                        + (f"{want} is in service" if want else "none is"),
                        fix or "`nightshift adapters promote` the version you want in service")]
    return [Finding("ok", "current", f"{want} is in service and matches the ledger")]


def _leftovers(state: Path, running: set[str]) -> list[Finding]:
    out = []
    ckpt = StatePaths(state).checkpoints
    closed = sorted(p.name for p in ckpt.iterdir() if p.name not in running) if ckpt.is_dir() else []
    if closed:
        out.append(Finding("note", "checkpoints", f"{len(closed)} checkpoint dir(s) of closed runs",
                           "removed when the next night starts"))
    for p in (state, StatePaths(state).adapters):
        if p.exists() and p.stat().st_mode & 0o050 != 0o050:
            out.append(Finding("note", "permissions", f"{p} cannot be entered by its group: the inference "
                               "server's user (in the group) cannot reach the versions", f"chmod g+rx {p}"))
    for p in (StatePaths(state).ledger, StatePaths(state).quarantine, ckpt):
        if p.exists() and p.stat().st_mode & 0o077:
            out.append(Finding("note", "permissions", f"{p} is readable by other users (raw user data)",
                               f"chmod {'600' if p.is_file() else '700'} {p}"))
    return out


def as_dicts(findings: list[Finding]) -> list[dict[str, str]]:
    return [asdict(f) for f in findings]


__all__ = ["Finding", "as_dicts", "diagnose"]
