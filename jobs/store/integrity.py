"""The ledger, the registry and `current` checked against each other (no torch).

The ledger is the source of truth of which version is in service; `current` must agree with it and
the version's files must match its manifest. The night uses these checks before it continues from a
version, `nightshift doctor` to report everything at once.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from jobs.contract import parse_version_name
from jobs.store.fallback import fall_back
from jobs.store.files import DamagedState
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths
from jobs.store.registry import IntegrityError, Registry
from jobs.store.schema import published_dirs

log = structlog.get_logger("nightshift.store")


def ledger_in_service(ledger: Ledger) -> int | None:
    """The version the ledger put in service last: the newest move of `current` (night, promote or
    rollback), else (a ledger from before that history) the most recently promoted version."""
    rows = ledger.promotions()
    if rows:
        return int(rows[-1]["version"])
    r = ledger.db.execute("SELECT version FROM versions WHERE promoted_at IS NOT NULL AND status='promoted'"
                          " ORDER BY promoted_at DESC LIMIT 1").fetchone()
    return int(r[0]) if r else None


def unknown_versions(registry: Registry, ledger: Ledger, name: str | None = None) -> list[str]:
    """Version directories in the registry the ledger has no row for (of adapter `name`, or any)."""
    known = {r["name"] for r in ledger.versions()}
    return [d for d in published_dirs(registry.state_dir)
            if d not in known and (name is None or (parse_version_name(d) or ("",))[0] == name)]


def check_registry_known(registry: Registry, ledger: Ledger, name: str) -> None:
    """Refuse a night when the registry holds versions of this adapter the ledger does not know: the
    ledger is older than the registry, so their samples would be trained again, their names reused."""
    unknown = unknown_versions(registry, ledger, name)
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise DamagedState(
            f"{registry.adapters / unknown[0]}{more} is a published version the ledger does not know: the "
            "ledger is older than the registry (restored from an old backup, or replaced). A night would train "
            "its samples again and could reuse its name. Restore the matching ledger, or move those directories "
            f"out of {registry.adapters}; `nightshift doctor` lists them")


def verified(registry: Registry, ledger: Ledger, version: int, *, role: str) -> Path:
    """The directory of a version a night continues from, after checking every file's sha256."""
    row = ledger.version(version)
    if row is None:
        raise DamagedState(f"the {role} v{version:04d} is not in the ledger; `nightshift doctor` explains")
    path = registry.adapters / row["name"]
    if row["status"] == "pruned" or not path.is_dir():
        raise DamagedState(
            f"the {role} {row['name']} is not on disk ({path} is missing): a night will not train from scratch in "
            f"its place. Restore {path}, or put a kept version in service (`nightshift adapters promote VERSION`)")
    try:
        registry.verify(path)
    except (IntegrityError, OSError, ValueError) as e:
        raise DamagedState(
            f"the {role} {row['name']} fails its integrity check ({e}): a night will not continue from it. "
            "Restore its files from a backup, or put a good version in service (`nightshift adapters rollback` "
            "or `nightshift adapters promote VERSION`)") from None
    return path


def parent_for_night(registry: Registry, ledger: Ledger, *, repair: bool, lock_timeout: float = 120.0) -> int | None:
    """The version tonight continues from: the one the ledger says is in service, verified.

    `current` missing, dangling or pointing elsewhere is repaired to it (under the registry lock, with a
    warning) when its files verify; when they do not, or it is gone, the night is refused (DamagedState)
    rather than trained from scratch and compared with the bare base model. None: nothing was ever
    promoted (and `current` is not set): a fresh lineage."""
    for _ in range(3):
        expected = ledger_in_service(ledger)
        problem = registry.current_problem()
        current = registry.current_version()
        if expected is None:
            if problem is None and registry.current() is None:
                return None
            raise DamagedState((problem or f"`current` points at {registry.current()}")
                               + ", but the ledger has never put a version in service; `nightshift doctor` explains")
        try:
            path = verified(registry, ledger, expected, role="version in service")
        except DamagedState as e:
            good = fall_back(registry, ledger, expected, str(e), lock_timeout=lock_timeout) if repair else None
            if good is None:
                raise
            continue  # the ledger now says `good` is in service: checked again from the top
        if problem is None and registry.current() == path.resolve():  # the very directory, not a copy elsewhere
            return expected
        was = problem or ("`current` is missing" if current is None else f"`current` points at {registry.current()}")
        if not repair:
            log.warning("current_disagrees_with_ledger", problem=was, in_service=path.name)
            return expected
        if registry.current_link.exists() and not registry.current_link.is_symlink():
            raise DamagedState(f"{was}; move it away and the next night restores `current` to {path.name}")
        with StateLock(StatePaths(registry.state_dir).lock, timeout=lock_timeout, what="restore current"):
            if ledger_in_service(ledger) == expected:  # else an operator moved it meanwhile: look again
                registry.promote(path)
                log.warning("current_restored", was=was, now=path.name,
                            why="the ledger says it is the version in service")
                return expected
    raise DamagedState("`current` kept moving while the night checked it; try again")
