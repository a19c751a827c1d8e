"""The SQLite ledger: the single source of truth of what was seen, planned, trained and published.

Every step is idempotent against it, so `kill -9` at any moment followed by a rerun
loses nothing and trains nothing twice. One file in the state directory, WAL mode,
short transactions; the daemon reads it, the night's child writes it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.contract import CalibrationRecord, HotswapOutcome, Plan, RunSummary
from jobs.contract.crashpoints import declare, reached
from jobs.contract.redact import redact_text
from jobs.store.schema import open_database

# Version statuses: training -> promoted | rejected | failed; any kept one -> pruned (files deleted,
# the row and its manifest stay: names are never reused). Promotion actions: night | promote | rollback.

# Run statuses. 'running' means a child owns it (or died owning it: resumable).
FINAL_RUN_STATUSES = ("succeeded", "rejected", "failed", "skipped")

# Crash points: each ledger write a restart must find, just after it committed (jobs/contract/crashpoints.py).
RUN_STARTED = declare("ledger.run_started", "a run row is open")
PLAN_SAVED = declare("ledger.plan_saved", "the plan, its samples and the reserved version number are stored")
RUN_FINISHED = declare("ledger.run_finished", "the run is closed")
SUMMARY_STORED = declare("ledger.summary_stored", "a closed run's final summary is stored")
PHASE_RECORDED = declare("ledger.phase_recorded", "a phase's duration is stored")
THROUGHPUT_RECORDED = declare("ledger.throughput_recorded", "the night's measured throughput is stored")
EVENT_ADDED = declare("ledger.event_added", "an event row is stored")
HOTSWAP_RECORDED = declare("ledger.hotswap_recorded", "one hot-swap target's outcome is stored")
STAT_KEY_REMEMBERED = declare("ledger.stat_key_remembered", "a known file's stat key is stored (no re-hash)")


@dataclass(frozen=True)
class SampleRow:
    id: int
    hash: str
    record: dict[str, Any]
    n_tokens: int
    source: str
    version: int | None = None  # the version that trained it (the replay pool's strata)


class Ledger:
    def __init__(self, path: Path, *, clock=time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self.db = open_database(self.path)  # DamagedState when it is not ours or missing next to versions

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic transaction (BEGIN IMMEDIATE: writers queue instead of failing)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---- files -------------------------------------------------------------------------------
    def file_known_by_stat(self, source: str, path: str, stat_key: str) -> bool:
        """Seen unchanged at this path: same device, inode, size, mtime and ctime (which no user can
        set back), so re-hashing it can be skipped. Identity is still the content hash."""
        q = "SELECT 1 FROM files WHERE source=? AND path=? AND stat_key=?"
        return self.db.execute(q, (source, path, stat_key)).fetchone() is not None

    def remember_stat_key(self, source: str, path: str, sha256: str, stat_key: str) -> None:
        self.db.execute("UPDATE files SET stat_key=? WHERE source=? AND path=? AND sha256=?",
                        (stat_key, source, path, sha256))
        reached(STAT_KEY_REMEMBERED)

    def file_by_stat(self, source: str, path: str, stat_key: str) -> int | None:
        q = "SELECT id FROM files WHERE source=? AND path=? AND stat_key=? ORDER BY id DESC LIMIT 1"
        r = self.db.execute(q, (source, path, stat_key)).fetchone()
        return None if r is None else int(r[0])

    def moved_files(self, source: str) -> list[tuple[str, str | None]]:
        """(where each moved file is now, its stat key as read): the latest row of each moved file."""
        q = ("SELECT moved_to, stat_key FROM files WHERE id IN (SELECT MAX(id) FROM files WHERE source=? AND "
             "moved_to IS NOT NULL GROUP BY moved_to)")
        return [(str(r[0]), r[1]) for r in self.db.execute(q, (source,))]

    def file_known_by_hash(self, source: str, sha256: str) -> bool:
        q = "SELECT 1 FROM files WHERE source=? AND sha256=?"
        return self.db.execute(q, (source, sha256)).fetchone() is not None

    def record_file(self, conn: sqlite3.Connection, *, source: str, path: str, size: int, mtime: float,
                    sha256: str, run_id: str, stat_key: str | None = None) -> int:
        cur = conn.execute(
            "INSERT INTO files (source, path, size, mtime, sha256, seen_at, run_id, stat_key)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (source, path, size, mtime, sha256, self.clock(), run_id, stat_key),
        )
        return int(cur.lastrowid)

    def finish_file(self, conn: sqlite3.Connection, file_id: int, *, records: int, accepted: int,
                    duplicates: int, quarantined: int) -> None:
        conn.execute(
            "UPDATE files SET records=?, accepted=?, duplicates=?, quarantined=? WHERE id=?",
            (records, accepted, duplicates, quarantined, file_id),
        )

    def set_file_moved(self, file_id: int, moved_to: str, stat_key: str | None) -> None:  # watched: its growth read
        self.db.execute("UPDATE files SET moved_to=?, stat_key=? WHERE id=?", (moved_to, stat_key, file_id))

    def refresh_moved(self, source: str, moved_to: str, stat_key: str) -> None:
        self.db.execute("UPDATE files SET stat_key=? WHERE source=? AND moved_to=?", (stat_key, source, moved_to))

    # ---- samples -----------------------------------------------------------------------------
    def add_sample(self, conn: sqlite3.Connection, *, hash: str, source: str, file_id: int, line: int,
                   record_json: str, n_tokens: int) -> bool:
        """Insert a pending sample (its record as JSON text, made where it was checked); False when the same
        content is already known (from any file)."""
        cur = conn.execute(
            "INSERT OR IGNORE INTO samples (hash, source, file_id, line, record, n_tokens, status, created_at)"
            " VALUES (?,?,?,?,?,?, 'pending', ?)",
            (hash, source, file_id, line, record_json, n_tokens, self.clock()),
        )
        return cur.rowcount == 1

    def add_quarantine(self, conn: sqlite3.Connection, *, run_id: str, source: str, file: str,
                       line: int | None, reason: str, detail: str) -> None:
        conn.execute(
            "INSERT INTO quarantine (run_id, source, file, line, reason, detail, at) VALUES (?,?,?,?,?,?,?)",
            (run_id, source, file, line, reason, detail, self.clock()),
        )

    def has_sample(self, hash: str) -> bool:
        return self.db.execute("SELECT 1 FROM samples WHERE hash=?", (hash,)).fetchone() is not None

    def pending(self, *, order: str = "oldest") -> list[SampleRow]:
        """Samples waiting to be trained, without their records (the plan needs ids, hashes, sizes)."""
        return self._sizes("pending", "ASC" if order == "oldest" else "DESC")

    def replay_pool(self) -> list[SampleRow]:
        """Every sample trained on an earlier night, without its record (the chosen ones are loaded by id)."""
        return self._sizes("trained", "ASC")

    def _sizes(self, status: str, direction: str) -> list[SampleRow]:
        rows = self.db.execute(
            f"SELECT id, hash, n_tokens, source FROM samples WHERE status=? ORDER BY id {direction}", (status,))
        return [SampleRow(int(r["id"]), r["hash"], {}, int(r["n_tokens"]), r["source"]) for r in rows]

    def sample_hashes(self, ids: Sequence[int]) -> list[tuple[int, str]]:
        """(id, content hash) of each, in order: what the token cache is keyed by, without parsing records."""
        out: dict[int, str] = {}
        for chunk in _chunks(list(ids), 500):
            q = f"SELECT id, hash FROM samples WHERE id IN ({','.join('?' * len(chunk))})"
            out.update((r[0], r[1]) for r in self.db.execute(q, chunk))
        return [(i, out[i]) for i in ids]

    def samples_by_id(self, ids: Sequence[int]) -> list[SampleRow]:
        out: dict[int, SampleRow] = {}
        for chunk in _chunks(list(ids), 500):
            marks = ",".join("?" * len(chunk))
            q = f"SELECT id, hash, record, n_tokens, source FROM samples WHERE id IN ({marks})"
            for r in self.db.execute(q, chunk):
                out[r["id"]] = _sample(r)
        return [out[i] for i in ids]

    def mark_trained(self, conn: sqlite3.Connection, sample_ids: Sequence[int], version: int) -> None:
        now = self.clock()
        for chunk in _chunks(list(sample_ids), 500):
            marks = ",".join("?" * len(chunk))
            conn.execute(
                f"UPDATE samples SET status='trained', version=?, trained_at=? "
                f"WHERE status='pending' AND id IN ({marks})",
                (version, now, *chunk),
            )

    def mark_heldout(self, conn: sqlite3.Connection, sample_ids: Sequence[int], version: int) -> None:
        """Held-out samples are never trained on: they measure each version on unseen data."""
        for chunk in _chunks(list(sample_ids), 500):
            marks = ",".join("?" * len(chunk))
            conn.execute(
                f"UPDATE samples SET status='heldout', version=? WHERE status='pending' AND id IN ({marks})",
                (version, *chunk),
            )

    def backlog(self) -> tuple[int, int]:
        r = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM samples WHERE status='pending'"
        ).fetchone()
        return int(r[0]), int(r[1])

    def sample_counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall()
        return {r[0]: int(r[1]) for r in rows}

    # ---- runs --------------------------------------------------------------------------------
    def open_run(self, night: str) -> sqlite3.Row | None:
        """The unfinished run of this night (crashed or interrupted), which a new start resumes."""
        return self.db.execute(
            "SELECT * FROM runs WHERE night=? AND status='running' ORDER BY started_at DESC LIMIT 1", (night,)
        ).fetchone()

    def night_done(self, night: str) -> bool:
        q = f"SELECT 1 FROM runs WHERE night=? AND status IN ({','.join('?' * len(FINAL_RUN_STATUSES))})"
        return self.db.execute(q, (night, *FINAL_RUN_STATUSES)).fetchone() is not None

    def start_run(self, run_id: str, night: str, deadline: float) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO runs (id, night, status, started_at, deadline) VALUES (?,?, 'running', ?, ?)",
                (run_id, night, self.clock(), deadline),
            )
        reached(RUN_STARTED)

    def resume_run(self, run_id: str, deadline: float) -> int:
        with self.tx() as c:
            c.execute("UPDATE runs SET attempt=attempt+1, deadline=? WHERE id=?", (deadline, run_id))
            return int(c.execute("SELECT attempt FROM runs WHERE id=?", (run_id,)).fetchone()[0])

    def run(self, run_id: str) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()

    def last_runs(self, n: int = 10) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT ?", (n,)).fetchall()

    def save_plan(self, run_id: str, plan: Plan, roles: Sequence[tuple[int, str]], version_name: str) -> None:
        """Store the plan, its samples in order and reserve the version number, atomically."""
        with self.tx() as c:
            c.execute("DELETE FROM run_samples WHERE run_id=?", (run_id,))
            c.executemany(
                "INSERT INTO run_samples (run_id, ord, sample_id, role) VALUES (?,?,?,?)",
                [(run_id, i, sid, role) for i, (sid, role) in enumerate(roles)],
            )
            c.execute("UPDATE runs SET plan=?, version=? WHERE id=?", (plan.model_dump_json(), plan.version, run_id))
            c.execute(
                "INSERT INTO versions (version, name, run_id, parent, status, created_at) VALUES (?,?,?,?,?,?)",
                (plan.version, version_name, run_id, plan.parent_version, "training", self.clock()),
            )
        reached(PLAN_SAVED)

    def plan_of(self, run: sqlite3.Row) -> Plan | None:
        return Plan.model_validate_json(run["plan"]) if run["plan"] else None

    def run_samples(self, run_id: str) -> list[tuple[int, str]]:
        rows = self.db.execute(
            "SELECT sample_id, role FROM run_samples WHERE run_id=? ORDER BY ord", (run_id,)
        ).fetchall()
        return [(int(r[0]), str(r[1])) for r in rows]

    def finish_run(self, run_id: str, status: str, *, summary: RunSummary | None = None,
                   error: str | None = None) -> None:
        with self.tx() as c:
            c.execute(
                "UPDATE runs SET status=?, ended_at=?, summary=COALESCE(?, summary), error=? WHERE id=?",
                (status, self.clock(), _summary_json(summary), redact_text(error) if error else None, run_id),
            )
            if status in ("failed", "skipped"):
                # Nothing was published under the number it reserved (a published version is
                # 'promoted' or 'rejected'): give the number back rather than burn it.
                c.execute("DELETE FROM versions WHERE run_id=? AND status='training'", (run_id,))
                c.execute("UPDATE runs SET version=NULL WHERE id=?", (run_id,))
        reached(RUN_FINISHED)

    def store_summary(self, run_id: str, summary: RunSummary) -> None:
        """The final summary (end time, backlog after the run) of a closed run."""
        self.db.execute("UPDATE runs SET summary=? WHERE id=? AND status != 'running'",
                        (_summary_json(summary), run_id))
        reached(SUMMARY_STORED)

    def summary_of(self, run: sqlite3.Row) -> RunSummary | None:
        """A run's stored summary, typed (None when it has none or it no longer validates)."""
        if not run["summary"]:
            return None
        try:
            return RunSummary.model_validate_json(run["summary"])
        except ValueError:
            return None

    def record_phase(self, run_id: str, phase: str, started_at: float, seconds: float) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO phases (run_id, phase, started_at, seconds) VALUES (?,?,?,?)",
            (run_id, phase, started_at, seconds),
        )
        reached(PHASE_RECORDED)

    # ---- throughput history ------------------------------------------------------------------
    def record_throughput(self, *, key: str, run_id: str | None, origin: str, tokens: int, seconds: float,
                          overhead_seconds: float | None, detail: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO throughput (key, run_id, at, origin, tokens, seconds, tokens_per_second,"
            " overhead_seconds, detail) VALUES (?,?,?,?,?,?,?,?,?)",
            (key, run_id, self.clock(), origin, tokens, seconds, tokens / seconds if seconds > 0 else 0.0,
             overhead_seconds, json.dumps(detail)),
        )
        reached(THROUGHPUT_RECORDED)

    def throughput_history(self, key: str, n: int = 5) -> list[sqlite3.Row]:
        return self.db.execute(
            "SELECT * FROM throughput WHERE key=? ORDER BY at DESC LIMIT ?", (key, n)
        ).fetchall()

    def record_calibration(self, key: str, record: CalibrationRecord, *, tokens: int, seconds: float) -> None:
        """A calibrate measurement: a throughput row for the planner, the record for the step shape."""
        self.record_throughput(key=key, run_id=None, origin="calibrate", tokens=tokens, seconds=seconds,
                               overhead_seconds=record.overhead_seconds, detail=record.model_dump(mode="json"))

    def calibration(self, key: str) -> CalibrationRecord | None:
        """What `nightshift calibrate` measured for this key, typed (None: never calibrated)."""
        r = self.db.execute(
            "SELECT detail FROM throughput WHERE key=? AND origin='calibrate' ORDER BY at DESC LIMIT 1", (key,)
        ).fetchone()
        return CalibrationRecord.model_validate_json(r[0]) if r else None

    # ---- versions ----------------------------------------------------------------------------
    def next_version(self) -> int:
        r = self.db.execute("SELECT COALESCE(MAX(version), 0) FROM versions").fetchone()
        return int(r[0]) + 1

    def version(self, version: int) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM versions WHERE version=?", (version,)).fetchone()

    def versions(self) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM versions ORDER BY version").fetchall()

    def set_version(self, conn: sqlite3.Connection, version: int, *, status: str, path: str | None = None,
                    manifest: dict[str, Any] | None = None, promoted: bool = False) -> None:
        conn.execute(
            "UPDATE versions SET status=?, path=COALESCE(?, path), manifest=COALESCE(?, manifest),"
            " promoted_at=CASE WHEN ? THEN ? ELSE promoted_at END WHERE version=?",
            (status, path, json.dumps(manifest) if manifest else None, promoted, self.clock(), version),
        )

    # ---- promotions, pins, prune, hot-swaps (the adapters commands) --------------------------
    def record_promotion(self, conn: sqlite3.Connection, version: int, *, action: str,
                         from_version: int | None, run_id: str | None = None) -> None:
        """Every move of `current`, in order: rollback walks this history (promoted_at alone cannot:
        it keeps only the last time a version was promoted)."""
        conn.execute(
            "INSERT INTO promotions (at, version, action, from_version, run_id) VALUES (?,?,?,?,?)",
            (self.clock(), version, action, from_version, run_id),
        )

    def promotions(self) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM promotions ORDER BY id").fetchall()

    def set_pinned(self, version: int, pinned: bool) -> None:
        if pinned:
            self.db.execute("INSERT OR IGNORE INTO pins (version, at) VALUES (?,?)", (version, self.clock()))
        else:
            self.db.execute("DELETE FROM pins WHERE version=?", (version,))

    def pinned(self) -> set[int]:
        return {int(r[0]) for r in self.db.execute("SELECT version FROM pins")}

    def mark_pruned(self, conn: sqlite3.Connection, version: int) -> None:
        conn.execute("UPDATE versions SET status='pruned' WHERE version=?", (version,))

    def record_hotswap(self, version: int, outcome: HotswapOutcome, *, trigger: str,
                       run_id: str | None = None) -> None:
        """One target's outcome for one announcement of a version."""
        o = outcome
        self.db.execute(
            "INSERT INTO hotswaps (at, version, trigger, run_id, target, kind, ok, attempts, seconds, error, detail)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (self.clock(), version, trigger, run_id, o.target, o.kind, int(o.ok), o.attempts, o.seconds,
             redact_text(o.error) if o.error else o.error, redact_text(json.dumps(o.detail, default=str))),
        )
        reached(HOTSWAP_RECORDED)

    def hotswaps(self, version: int | None = None) -> list[sqlite3.Row]:
        if version is None:
            return self.db.execute("SELECT * FROM hotswaps ORDER BY id").fetchall()
        return self.db.execute("SELECT * FROM hotswaps WHERE version=? ORDER BY id", (version,)).fetchall()

    def add_event(self, kind: str, *, run_id: str | None = None, version: int | None = None,
                  detail: dict[str, Any] | None = None) -> None:
        self.db.execute(
            "INSERT INTO events (at, kind, run_id, version, detail) VALUES (?,?,?,?,?)",
            (self.clock(), kind, run_id, version, redact_text(json.dumps(detail or {}))),
        )
        reached(EVENT_ADDED)

def _summary_json(summary: RunSummary | None) -> str | None:  # URLs in it (hot-swap errors) redacted
    return None if summary is None else redact_text(summary.model_dump_json())


def _sample(r: sqlite3.Row) -> SampleRow:
    return SampleRow(int(r["id"]), r["hash"], json.loads(r["record"]), int(r["n_tokens"]), r["source"])


def _chunks(xs: list[int], n: int) -> Iterator[list[int]]:
    for i in range(0, len(xs), n):
        yield xs[i : i + n]
