"""The ledger's learning schema and records: the migration, rejected nights' samples, the regression
set, loss curves and the reference."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from jobs.store import learning
from jobs.store.learning_schema import SAMPLE_STATUSES
from jobs.store.ledger import Ledger
from jobs.store.schema import SCHEMA


def add(led: Ledger, n: int, source: str = "s", start: int = 0) -> None:
    with led.tx() as c:
        for i in range(start, start + n):
            led.add_sample(c, hash=f"{i:064x}", source=source, file_id=1, line=i,
                           record_json=f'{{"text": "t{i}"}}',
                           n_tokens=10)


def statuses(led: Ledger) -> dict[int, str]:
    return {int(r[0]): r[1] for r in led.db.execute("SELECT id, status FROM samples")}


def test_a_ledger_written_before_is_migrated_once_keeping_every_row(tmp_path: Path):
    path = tmp_path / "ledger.sqlite"
    old = sqlite3.connect(path, isolation_level=None)
    old.executescript(SCHEMA)
    old.executemany("INSERT INTO samples (hash, source, record, n_tokens, status, version, created_at) "
                    "VALUES (?, 's', '{}', 5, ?, ?, 0)",
                    [("a", "trained", 1), ("b", "heldout", 1), ("c", "pending", None)])
    old.execute("INSERT INTO runs (id, night, status, started_at) VALUES ('r1', '2026-11-20', 'succeeded', 0)")
    old.execute("INSERT INTO versions (version, name, run_id, status, created_at, promoted_at) "
                "VALUES (1, 't-v0001', 'r1', 'promoted', 0, 1)")
    old.execute("INSERT INTO promotions (at, version, action) VALUES (1, 1, 'night')")
    old.close()
    led = Ledger(path)
    assert statuses(led) == {1: "trained", 2: "heldout", 3: "pending"}
    assert learning.regression_ids(led, 10) == [(2, "2026-11-20/s")]  # the held-out sample of a promoted night
    assert learning.reference_version(led) == 1  # the version in service when the reference began
    assert led.db.execute("SELECT version FROM samples WHERE id=1").fetchone()[0] == 1
    with pytest.raises(sqlite3.IntegrityError):  # the CHECK constraint is still there, with the new statuses
        led.db.execute("UPDATE samples SET status='forgotten' WHERE id=1")
    led.db.execute("UPDATE samples SET status='set_aside', rejections=2 WHERE id=3")
    add(led, 1, start=10)  # AUTOINCREMENT goes on after the kept ids
    assert max(statuses(led)) == 4 and led.sample_counts() == {"trained": 1, "heldout": 1, "set_aside": 1,
                                                              "pending": 1}
    led.close()
    again = Ledger(path)  # idempotent: nothing rebuilt, nothing lost
    assert statuses(again)[3] == "set_aside" and set(SAMPLE_STATUSES) >= set(statuses(again).values())
    tables = {r[0] for r in again.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"regression_set", "loss_curve", "references_history"} <= tables and "samples_v2" not in tables


def test_a_rejected_nights_samples_go_back_and_twice_rejected_ones_are_set_aside(tmp_path: Path):
    led = Ledger(tmp_path / "ledger.sqlite")
    add(led, 6)
    with led.tx() as c:
        assert learning.return_rejected(led, c, [1, 2, 3], version=4, reason="regression.exact_match 1 -> 0.2",
                                        mode="pending", set_aside_after=2) == (3, 0)
    assert statuses(led) == dict.fromkeys(range(1, 7), "pending")  # back in the backlog, trained by nobody
    with led.tx() as c:  # the same samples in another rejected night (with a new one)
        assert learning.return_rejected(led, c, [1, 2, 4], version=5, reason="again", mode="pending",
                                        set_aside_after=2) == (3, 2)
    assert [statuses(led)[i] for i in (1, 2, 3, 4)] == ["set_aside", "set_aside", "pending", "pending"]
    reason = led.db.execute("SELECT reason FROM samples WHERE id=1").fetchone()[0]
    assert reason == "v4: regression.exact_match 1 -> 0.2 | v5: again"
    aside = learning.set_aside(led)
    assert aside["samples"] == 2 and aside["reasons"] == {"v4: regression.exact_match 1 -> 0.2": 2}
    assert aside["ever_rejected"] == 4
    assert [s.id for s in led.pending()] == [3, 4, 5, 6]  # set-aside samples are out of every plan
    with led.tx() as c:  # configured to keep them out: 'rejected', never trained nor replayed
        learning.return_rejected(led, c, [5], version=6, reason="x", mode="rejected", set_aside_after=2)
        learning.return_rejected(led, c, [6], version=6, reason="held back", mode="rejected", set_aside_after=2,
                                 count=False)  # not the data's fault: back to pending, not counted
    assert statuses(led)[5] == "rejected" and statuses(led)[6] == "pending"
    assert led.db.execute("SELECT rejections FROM samples WHERE id=6").fetchone()[0] == 0


def test_the_regression_set_grows_by_slices_and_a_cap_keeps_every_slice(tmp_path: Path):
    led = Ledger(tmp_path / "ledger.sqlite")
    add(led, 40, source="a")
    add(led, 5, source="b", start=40)
    with led.tx() as c:
        led.mark_heldout(c, list(range(1, 46)), version=1)
        rows = led.samples_by_id(list(range(1, 46)))
        n1 = learning.add_regression_slices(led, c, [r for r in rows if r.id <= 30 or r.id > 40], night="n1",
                                            version=1, per_slice=8)
        n2 = learning.add_regression_slices(led, c, [r for r in rows if 30 < r.id <= 40], night="n2", version=2,
                                            per_slice=8)
    assert (n1, n2) == (8 + 5, 8)  # per night and source, at most per_slice
    assert learning.regression_size(led) == (21, 3)
    picked = learning.regression_ids(led, 6)
    assert [name for _, name in picked] == ["n1/a", "n1/b", "n2/a"] * 2  # round-robin: every slice in
    assert len(learning.regression_ids(led, 100)) == 21
    led.db.execute("UPDATE samples SET status='trained' WHERE id=1")  # no longer held out: not a regression sample
    assert 1 not in {sid for sid, _ in learning.regression_ids(led, 100)}


def test_loss_curves_and_the_reference_history(tmp_path: Path):
    led = Ledger(tmp_path / "ledger.sqlite")
    with led.tx() as c:
        learning.record_loss_curve(c, "r1", [(1, 2.5), (2, 1.25)])
    assert learning.loss_curve(led, "r1") == [(1, 2.5), (2, 1.25)] and learning.loss_curve(led, "r2") == []
    assert learning.reference_version(led) is None  # the base model until a version is promoted
    with led.tx() as c:
        learning.set_reference(led, c, 1, run_id="r1", detail={})
        learning.set_reference(led, c, 3, run_id="r3", detail={"regression": {"exact_match": 1.0}})
    assert learning.reference_version(led) == 3


def test_the_retention_set_is_what_the_reference_was_trained_on_round_robin_and_never_tonights(tmp_path: Path):
    led = Ledger(tmp_path / "ledger.sqlite")
    db = led.db
    for v, (night, status, promoted) in enumerate((("2026-12-01", "promoted", 1), ("2026-12-02", "rejected", None),
                                                   ("2026-12-03", "promoted", 3), ("2026-12-04", "promoted", 4)), 1):
        db.execute("INSERT INTO runs (id, night, status, started_at) VALUES (?, ?, 'succeeded', 0)", (f"r{v}", night))
        db.execute("INSERT INTO versions (version, name, run_id, status, created_at, promoted_at) "
                   "VALUES (?, ?, ?, ?, 0, ?)", (v, f"t-v{v:04d}", f"r{v}", status, promoted))
    rows = [("a", 1, "trained"), ("b", 1, "trained"), ("c", 1, "trained"), ("d", 1, "heldout"),
            ("e", 2, "trained"), ("f", 3, "trained"), ("g", 4, "trained"), ("h", 1, "trained")]
    for h, v, st in rows:
        db.execute("INSERT INTO samples (hash, source, record, n_tokens, status, version, created_at) "
                   "VALUES (?, ?, '{}', 5, ?, ?, 0)", (h, "y" if h == "h" else "x", st, v))
    ids = {h: i + 1 for i, (h, _, _) in enumerate(rows)}
    assert learning.retention_ids(led, 10, upto=None, exclude=set()) == []  # no reference: nothing to retain
    got = learning.retention_ids(led, 10, upto=3, exclude={ids["b"]})
    # trained by promoted versions up to the reference (v3): never a held-out sample, a rejected night's,
    # a later night's, nor tonight's (b, replayed again tonight); one slice per night and source
    assert got == [(ids["a"], "2026-12-01/x"), (ids["h"], "2026-12-01/y"), (ids["f"], "2026-12-03/x"),
                   (ids["c"], "2026-12-01/x")]
    assert learning.retention_ids(led, 3, upto=3, exclude=set()) == [
        (ids["a"], "2026-12-01/x"), (ids["h"], "2026-12-01/y"), (ids["f"], "2026-12-03/x")]  # every slice first
    assert learning.retention_ids(led, 0, upto=3, exclude=set()) == []
