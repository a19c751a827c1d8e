"""Files a rejected night blamed: held out of plans, quarantined at the second fault, released when clean;
the table arrives by migration step 4 on a ledger written before it (issue 39)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from jobs.store import file_strikes, learning
from jobs.store.ledger import Ledger
from jobs.store.schema import LATEST, MIGRATIONS


def ledger_with_two_files(path: Path) -> Ledger:
    led = Ledger(path)
    with led.tx() as c:
        for fid, name in ((1, "good.jsonl"), (2, "bad.jsonl")):
            c.execute("INSERT INTO files (id, source, path, size, mtime, sha256, seen_at) VALUES (?,?,?,?,?,?,?)",
                      (fid, "s", f"/inbox/{name}", 1, 0, f"{fid}" * 64, 0))
            for i in range(3):
                led.add_sample(c, hash=f"{fid}{i:063x}", source="s", file_id=fid, line=i,
                               record_json=f'{{"text": "t{fid}{i}"}}', n_tokens=10)
    return led


def test_a_blamed_file_is_held_then_quarantined_with_its_reasons_and_the_rest_stays_pending(tmp_path: Path):
    led = ledger_with_two_files(tmp_path / "ledger.sqlite")
    assert file_strikes.files_of(led, [1, 2, 4, 6]) == {1: [1, 2], 2: [4, 6]}
    with led.tx() as c:
        row = file_strikes.strike(led, c, 2, version=4, reason="regression.exact_match 1 -> 0.8")
    assert row.status == "held" and row.path == "/inbox/bad.jsonl" and row.strikes == 1
    assert [p.id for p in led.pending()] == [1, 2, 3]  # the good file still learns; the bad one waits
    assert [f.file_id for f in file_strikes.held(led)] == [2]
    assert file_strikes.held_samples(led, 2, 10) == [4, 5, 6]
    with led.tx() as c:
        row = file_strikes.strike(led, c, 2, version=5, reason="scored against v5's answers")
    assert row.status == "quarantined" and "v4: regression" in row.reason and "v5: scored" in row.reason
    aside = led.db.execute("SELECT status, rejections, reason FROM samples WHERE file_id=2").fetchall()
    assert all(st == "set_aside" and n == 2 and "file v5: scored" in why for st, n, why in aside)
    assert learning.set_aside(led)["samples"] == 3 and not file_strikes.held(led)


def test_a_held_file_scored_clean_is_released_to_pending(tmp_path: Path):
    led = ledger_with_two_files(tmp_path / "ledger.sqlite")
    with led.tx() as c:
        file_strikes.strike(led, c, 1, version=4, reason="r")
    assert [p.id for p in led.pending()] == [4, 5, 6]
    with led.tx() as c:
        file_strikes.release(led, c, 1)
    assert [p.id for p in led.pending()] == [1, 2, 3, 4, 5, 6]
    assert [(f.file_id, f.status) for f in file_strikes.all_files(led)] == [(1, "released")]


def test_a_ledger_at_step_3_gains_the_table_and_keeps_its_rows(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    for step in MIGRATIONS[:3]:  # a ledger written by the code before step 4
        db.execute("BEGIN")
        step.apply(db)
        db.execute(f"PRAGMA user_version={step.version}")
        db.execute("COMMIT")
    db.execute("INSERT INTO samples (hash, source, record, n_tokens, status, created_at) "
               "VALUES ('a', 's', '{}', 5, 'pending', 0)")
    db.close()
    led = Ledger(path)
    assert led.db.execute("PRAGMA user_version").fetchone()[0] == LATEST >= 4
    assert [p.id for p in led.pending()] == [1] and file_strikes.all_files(led) == []
