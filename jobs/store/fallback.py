"""A version in service whose files fail their checksums: fall back to the nearest good ancestor.

Its manifest lists the sha256 of every file; a torn or bit-flipped file no longer matches. Rather than
refuse every night until an operator acts, the night walks the lineage back (parent, grandparent, ...)
to the nearest version whose files all verify, puts it in service (a recorded rollback, under the
registry lock) and continues from it. The samples only the skipped versions had learned go back to
pending: no adapter that can be served holds them any more, so they are trained again, once. With no
good ancestor the night is refused as before (it never trains from scratch in a version's place).

A repair, like the night's other recovery steps, ordered to be safe at any kill: the ledger first (the
rollback and the samples pending, one transaction), then `current`, which the next night moves to what
the ledger says if a kill came in between (jobs/store/integrity.py).
"""

from __future__ import annotations

from pathlib import Path

import structlog

from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths
from jobs.store.registry import IntegrityError, Registry

log = structlog.get_logger("nightshift.store")


def good_ancestor(registry: Registry, ledger: Ledger, version: int) -> tuple[int, Path, list[int]] | None:
    """(the nearest ancestor whose files verify, its path, the versions skipped on the way, `version` first)."""
    skipped, row = [version], ledger.version(version)
    while row is not None and row["parent"] is not None:
        row = ledger.version(int(row["parent"]))
        if row is None:
            return None
        path = registry.adapters / row["name"]
        if row["status"] == "promoted" and path.is_dir():
            try:
                registry.verify(path)
                return int(row["version"]), path, skipped
            except (IntegrityError, OSError, ValueError):
                pass
        skipped.append(int(row["version"]))
    return None


def fall_back(registry: Registry, ledger: Ledger, version: int, why: str, *, lock_timeout: float) -> int | None:
    """Put the nearest good ancestor of `version` in service; None when there is none (the caller refuses)."""
    with StateLock(StatePaths(registry.state_dir).lock, timeout=lock_timeout, what="integrity fallback"):
        found = good_ancestor(registry, ledger, version)
        if found is None:
            return None
        good, path, skipped = found
        marks = ",".join("?" * len(skipped))
        with ledger.tx() as c:
            back = c.execute(f"UPDATE samples SET status='pending', version=NULL, trained_at=NULL "
                             f"WHERE status='trained' AND version IN ({marks})", skipped).rowcount
            ledger.record_promotion(c, good, action="rollback", from_version=version)
        ledger.add_event("integrity_fallback", version=good,
                         detail={"from_version": version, "skipped": skipped, "why": why, "samples_pending": back})
        registry.promote(path)  # a kill before this: the next night finds `current` behind the ledger and moves it
    log.error("integrity_fallback", failed=version, now=good, skipped=skipped, samples_pending_again=back, why=why)
    return good
