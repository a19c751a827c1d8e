"""What the ledger keeps so that learning holds night after night (schema: learning_schema.py).

- The regression set grows by itself: when a night is promoted, its held-out samples (at most
  `per_slice` per source) become a slice of it, named "<night>/<source>"; every later candidate is
  measured on them. Evaluation takes the slices round-robin, so a cap keeps every night in it.
- A rejected night's samples go back (to pending, or to 'rejected'); a sample rejected
  `set_aside_after` times is set aside with its reasons, out of every later plan.
- The retention set: samples trained by the promoted versions up to the gate's reference, round-robin
  over their nights and sources: what the best version learned, that a candidate must still answer.
- The replay pool holds trained samples of versions that were not rejected, with their version
  (the night that trained them) for the stratified choice.
- Each run's loss per step, and the history of the gate's reference version.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

from jobs.store.ledger import Ledger, SampleRow

RejectMode = Literal["pending", "rejected"]


def replay_pool(ledger: Ledger) -> list[SampleRow]:
    """Samples trained by versions that were not rejected, without records, with their version."""
    rows = ledger.db.execute(
        "SELECT s.id, s.hash, s.n_tokens, s.source, s.version FROM samples s WHERE s.status='trained' AND NOT"
        " EXISTS (SELECT 1 FROM versions v WHERE v.version=s.version AND v.status IN ('rejected', 'failed'))"
        " ORDER BY s.id")
    return [SampleRow(int(r[0]), r[1], {}, int(r[2]), r[3], r[4]) for r in rows]


def return_rejected(ledger: Ledger, conn: sqlite3.Connection, sample_ids: Sequence[int], *, version: int,
                    reason: str, mode: RejectMode, set_aside_after: int, count: bool = True) -> tuple[int, int]:
    """A rejected night's new samples (trained and held out) were never learned by the adapter in
    service: they go back to pending (or to 'rejected'), each rejection counted with its reason;
    at `set_aside_after` rejections a sample is set aside. `count=False`: a night held back for
    no fault of its data (the version in service changed meanwhile). Returns (returned, set aside)."""
    ids = list(sample_ids)
    note = f"v{version}: {reason}"
    inc = 1 if count else 0
    for chunk in _chunks(ids, 500):
        marks = ",".join("?" * len(chunk))
        conn.execute(
            f"UPDATE samples SET rejections=rejections+?, reason=CASE WHEN ? THEN "
            f"COALESCE(reason || ' | ', '') || ? ELSE reason END WHERE status='pending' AND id IN ({marks})",
            (inc, count, note, *chunk))
        conn.execute(
            f"UPDATE samples SET status='set_aside', version=? WHERE status='pending' AND rejections>=? "
            f"AND id IN ({marks})", (version, set_aside_after, *chunk))
        if mode == "rejected" and count:
            conn.execute(f"UPDATE samples SET status='rejected', version=? WHERE status='pending' "
                         f"AND id IN ({marks})", (version, *chunk))
    aside = 0
    for chunk in _chunks(ids, 500):
        marks = ",".join("?" * len(chunk))
        aside += int(conn.execute(f"SELECT COUNT(*) FROM samples WHERE status='set_aside' AND version=? "
                                  f"AND id IN ({marks})", (version, *chunk)).fetchone()[0])
    return len(ids), aside


def set_aside(ledger: Ledger) -> dict[str, Any]:
    """What was set aside and why (the first reason of each sample, the version that rejected it)."""
    rows = ledger.db.execute("SELECT reason, COUNT(*) FROM samples WHERE status='set_aside' GROUP BY reason")
    reasons: dict[str, int] = defaultdict(int)
    for reason, n in rows:
        reasons[str(reason or "").split(" | ")[0]] += int(n)
    returned = ledger.db.execute("SELECT COUNT(*) FROM samples WHERE rejections > 0").fetchone()[0]
    return {"samples": sum(reasons.values()), "reasons": dict(reasons), "ever_rejected": int(returned)}


# ---- the regression set ------------------------------------------------------------------------
def add_regression_slices(ledger: Ledger, conn: sqlite3.Connection, rows: Sequence[SampleRow], *, night: str,
                          version: int, per_slice: int) -> int:
    """A promoted night's held-out samples join the regression set: at most `per_slice` per source."""
    by_source: dict[str, list[SampleRow]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r.id):
        by_source[r.source].append(r)
    added = 0
    for source, group in by_source.items():
        for r in group[:per_slice]:
            cur = conn.execute("INSERT OR IGNORE INTO regression_set (sample_id, night, source, version, added_at)"
                               " VALUES (?,?,?,?,?)", (r.id, night, source, version, ledger.clock()))
            added += cur.rowcount
    return added


def regression_ids(ledger: Ledger, cap: int) -> list[tuple[int, str]]:
    """(sample id, slice) of the regression set, round-robin over the slices (oldest night first), so
    that a cap keeps every slice in it; held-out samples only (never trained)."""
    rows = ledger.db.execute(
        "SELECT r.sample_id, r.night, r.source FROM regression_set r JOIN samples s ON s.id = r.sample_id "
        "WHERE s.status='heldout' ORDER BY r.night, r.source, r.sample_id").fetchall()
    return _round_robin(rows, cap)


def retention_ids(ledger: Ledger, cap: int, *, upto: int | None, exclude: set[int]) -> list[tuple[int, str]]:
    """(sample id, slice) of the samples trained by promoted versions up to `upto` (the reference: what the
    best version learned), round-robin over "<night>/<source>" slices under `cap`; `exclude`: tonight's
    (replayed samples are trained again tonight). None: no reference yet, nothing to retain."""
    if upto is None or cap <= 0:
        return []
    rows = ledger.db.execute(
        "SELECT s.id, COALESCE(r.night, 'v' || s.version), s.source FROM samples s JOIN versions v ON "
        "v.version = s.version LEFT JOIN runs r ON r.id = v.run_id WHERE s.status='trained' AND s.version <= ? "
        "AND v.promoted_at IS NOT NULL AND v.status NOT IN ('rejected', 'failed') ORDER BY s.version, s.source, s.id",
        (upto,)).fetchall()
    return _round_robin([r for r in rows if int(r[0]) not in exclude], cap)


def _round_robin(rows: Sequence[tuple[Any, ...]], cap: int) -> list[tuple[int, str]]:
    slices: dict[str, list[int]] = {}
    for sid, night, source in rows:
        slices.setdefault(f"{night}/{source}", []).append(int(sid))
    out: list[tuple[int, str]] = []
    depth = 0
    while len(out) < cap and any(len(v) > depth for v in slices.values()):
        for name, ids in slices.items():
            if depth < len(ids) and len(out) < cap:
                out.append((ids[depth], name))
        depth += 1
    return out


def recent_heldout(ledger: Ledger, n: int, *, exclude: set[int]) -> list[int]:
    """Up to `n` held-out samples of the most recent promoted nights (newest first): the pool that tops up a
    night with too few held-out samples of its own."""
    if n <= 0:
        return []
    rows = ledger.db.execute("SELECT id FROM samples WHERE status='heldout' ORDER BY id DESC LIMIT ?",
                             (n + len(exclude),))
    return [int(r[0]) for r in rows if int(r[0]) not in exclude][:n]


def regression_size(ledger: Ledger) -> tuple[int, int]:
    """(samples, slices) of the regression set."""
    r = ledger.db.execute("SELECT COUNT(*), COUNT(DISTINCT night || '/' || source) FROM regression_set").fetchone()
    return int(r[0]), int(r[1])


# ---- loss curves and the reference --------------------------------------------------------------
def record_loss_curve(conn: sqlite3.Connection, run_id: str, curve: Sequence[tuple[int, float]]) -> None:
    conn.executemany("INSERT OR REPLACE INTO loss_curve (run_id, step, loss) VALUES (?,?,?)",
                     [(run_id, int(step), float(loss)) for step, loss in curve])


def loss_curve(ledger: Ledger, run_id: str) -> list[tuple[int, float]]:
    rows = ledger.db.execute("SELECT step, loss FROM loss_curve WHERE run_id=? ORDER BY step", (run_id,))
    return [(int(s), float(v)) for s, v in rows]


def reference_version(ledger: Ledger) -> int | None:
    """The gate's reference: the best promoted version so far (None: none yet, the base model)."""
    r = ledger.db.execute("SELECT version FROM references_history ORDER BY id DESC LIMIT 1").fetchone()
    return int(r[0]) if r else None


def set_reference(ledger: Ledger, conn: sqlite3.Connection, version: int, *, run_id: str,
                  detail: dict[str, Any]) -> None:
    conn.execute("INSERT INTO references_history (at, version, run_id, detail) VALUES (?,?,?,?)",
                 (ledger.clock(), version, run_id, json.dumps(detail, default=str)))


def _chunks(xs: list[int], n: int) -> list[list[int]]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]
