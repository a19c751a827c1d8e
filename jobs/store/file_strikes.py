"""Files a rejected night blamed (jobs/night/isolate.py): held out of the plans, quarantined at the second fault.

A file blamed once is `held`: its samples wait in status 'rejected' (out of every plan and of replay)
while the rest of the rejected night goes back to pending uncounted, so the next, clean night learns it
without the bad data. A later promoted night scores the held file again: blamed again, it is
`quarantined` (its samples set aside with the reason), else `released` (its samples pending again).
Schema: migration step 4 (jobs/store/learning_schema.py, `migrate_file_strikes`).
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from jobs.store.ledger import Ledger

FileStatus = Literal["held", "quarantined", "released"]
@dataclass(frozen=True)
class FileRow:
    file_id: int
    path: str
    strikes: int
    status: FileStatus
    reason: str


def files_of(ledger: Ledger, sample_ids: Sequence[int]) -> dict[int, list[int]]:
    """file id -> its samples among `sample_ids` (samples of no file: file id 0)."""
    out: dict[int, list[int]] = defaultdict(list)
    ids = list(sample_ids)
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        q = f"SELECT id, COALESCE(file_id, 0) FROM samples WHERE id IN ({','.join('?' * len(chunk))})"
        for sid, fid in ledger.db.execute(q, chunk):
            out[int(fid)].append(int(sid))
    return dict(out)


def path_of(ledger: Ledger, file_id: int) -> str:
    r = ledger.db.execute("SELECT path FROM files WHERE id=?", (file_id,)).fetchone()
    return str(r[0]) if r else f"file {file_id}"


def strike(ledger: Ledger, conn: sqlite3.Connection, file_id: int, *, version: int, reason: str) -> FileRow:
    """One more fault: held at the first, quarantined at the second (its samples set aside with the reason)."""
    row = conn.execute("SELECT strikes, reason FROM file_strikes WHERE file_id=?", (file_id,)).fetchone()
    strikes = (int(row[0]) if row else 0) + 1
    why = f"v{version}: {reason}" if not row or not row[1] else f"{row[1]} | v{version}: {reason}"
    status: FileStatus = "quarantined" if strikes >= 2 else "held"
    conn.execute("INSERT OR REPLACE INTO file_strikes (file_id, strikes, status, reason, at) VALUES (?,?,?,?,?)",
                 (file_id, strikes, status, why, ledger.clock()))
    new_status = "set_aside" if status == "quarantined" else "rejected"
    conn.execute("UPDATE samples SET status=?, version=?, rejections=rejections+1, "
                 "reason=COALESCE(reason || ' | ', '') || ? WHERE file_id=? AND status IN ('pending', 'rejected')",
                 (new_status, version, f"file v{version}: {reason}", file_id))
    return FileRow(file_id, path_of(ledger, file_id), strikes, status, why)


def release(ledger: Ledger, conn: sqlite3.Connection, file_id: int) -> None:
    """Scored clean by a later night: its samples train again."""
    conn.execute("UPDATE file_strikes SET status='released', at=? WHERE file_id=?", (ledger.clock(), file_id))
    conn.execute("UPDATE samples SET status='pending' WHERE file_id=? AND status='rejected'", (file_id,))


def held(ledger: Ledger) -> list[FileRow]:
    rows = ledger.db.execute("SELECT file_id, strikes, status, reason FROM file_strikes WHERE status='held' "
                             "ORDER BY file_id").fetchall()
    return [FileRow(int(r[0]), path_of(ledger, int(r[0])), int(r[1]), r[2], r[3] or "") for r in rows]


def held_samples(ledger: Ledger, file_id: int, limit: int) -> list[int]:
    rows = ledger.db.execute("SELECT id FROM samples WHERE file_id=? AND status='rejected' ORDER BY id LIMIT ?",
                             (file_id, limit))
    return [int(r[0]) for r in rows]


def all_files(ledger: Ledger) -> list[FileRow]:
    rows = ledger.db.execute("SELECT file_id, strikes, status, reason FROM file_strikes ORDER BY file_id").fetchall()
    return [FileRow(int(r[0]), path_of(ledger, int(r[0])), int(r[1]), r[2], r[3] or "") for r in rows]
