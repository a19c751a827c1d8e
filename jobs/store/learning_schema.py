"""The ledger's schema for learning that holds night after night (issue 12), in one idempotent step.

Step 3 of the ledger's migrations (jobs/store/schema.py), run once per ledger inside the step's
transaction, on a new ledger and on one written before it:

- samples.status gains 'rejected' (a rejected night's samples kept out of training and replay, when
  configured so) and 'set_aside' (rejected too many times); SQLite cannot alter a CHECK constraint,
  so the table is rebuilt once, in one transaction, keeping every row and id;
- samples gain `rejections` (how many rejected nights trained them) and `reason` (the last one);
- regression_set: the held-out samples of promoted nights that every later candidate is measured
  on, one slice per night and source; created from the held-out samples of the promoted versions
  a ledger already has (32 per version and source, the default cap);
- loss_curve: each run's training loss per optimizer step;
- references_history: the gate's reference version (the best promoted so far); on a ledger that
  has promotions already, it starts at the version promoted last.
"""

from __future__ import annotations

import sqlite3

SAMPLE_STATUSES = ("pending", "trained", "heldout", "rejected", "set_aside")

SAMPLES_V2 = f"""
CREATE TABLE samples_v2 (
  id INTEGER PRIMARY KEY AUTOINCREMENT, hash TEXT NOT NULL UNIQUE, source TEXT NOT NULL,
  file_id INTEGER, line INTEGER, record TEXT NOT NULL, n_tokens INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ({", ".join(f"'{s}'" for s in SAMPLE_STATUSES)})), version INTEGER,
  created_at REAL NOT NULL, trained_at REAL, rejections INTEGER NOT NULL DEFAULT 0, reason TEXT)
"""
OLD_COLUMNS = "id, hash, source, file_id, line, record, n_tokens, status, version, created_at, trained_at"

TABLES = """
CREATE TABLE IF NOT EXISTS regression_set (
  sample_id INTEGER PRIMARY KEY, night TEXT NOT NULL, source TEXT NOT NULL, version INTEGER NOT NULL,
  added_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS regression_by_slice ON regression_set (night, source, sample_id);
CREATE TABLE IF NOT EXISTS loss_curve (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL NOT NULL, PRIMARY KEY (run_id, step));
CREATE TABLE IF NOT EXISTS references_history (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, version INTEGER NOT NULL, run_id TEXT, detail TEXT);
"""


BACKFILL = """
INSERT OR IGNORE INTO regression_set (sample_id, night, source, version, added_at)
SELECT id, night, source, version, strftime('%s', 'now') FROM (
  SELECT s.id, COALESCE(r.night, 'v' || s.version) AS night, s.source, s.version,
         ROW_NUMBER() OVER (PARTITION BY s.version, s.source ORDER BY s.id) AS n
  FROM samples s JOIN versions v ON v.version = s.version LEFT JOIN runs r ON r.id = v.run_id
  WHERE s.status = 'heldout' AND v.promoted_at IS NOT NULL)
WHERE n <= 32;
INSERT INTO references_history (at, version, run_id, detail)
SELECT strftime('%s', 'now'), version, run_id, '{"from": "the last promotion before the reference existed"}'
FROM promotions ORDER BY id DESC LIMIT 1;
"""


def migrate(c: sqlite3.Connection) -> None:
    """Migration step 3 (jobs/store/schema.py), inside the step's transaction."""
    new_regression_set = not c.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='regression_set'").fetchone()
    if "'set_aside'" not in _samples_sql(c):
        _rebuild_samples(c)
    for statement in (TABLES + (BACKFILL if new_regression_set else "")).split(";"):
        if statement.strip():
            c.execute(statement)


def _samples_sql(db: sqlite3.Connection) -> str:
    row = db.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name='samples'").fetchone()
    return str(row[0]) if row else ""


def _rebuild_samples(db: sqlite3.Connection) -> None:
    db.execute("DROP TABLE IF EXISTS samples_v2")
    db.execute(SAMPLES_V2)
    db.execute(f"INSERT INTO samples_v2 ({OLD_COLUMNS}) SELECT {OLD_COLUMNS} FROM samples")
    db.execute("DROP TABLE samples")
    db.execute("ALTER TABLE samples_v2 RENAME TO samples")
    db.execute("CREATE INDEX IF NOT EXISTS samples_by_status ON samples (status, id)")


FILE_STRIKES = """
CREATE TABLE IF NOT EXISTS file_strikes (
  file_id INTEGER PRIMARY KEY, strikes INTEGER NOT NULL, status TEXT NOT NULL, reason TEXT, at REAL NOT NULL)
"""


def migrate_file_strikes(c: sqlite3.Connection) -> None:
    """Migration step 4: the files a rejected night blamed (jobs/store/file_strikes.py), held then quarantined."""
    c.execute(FILE_STRIKES)
