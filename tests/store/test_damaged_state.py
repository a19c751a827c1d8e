"""Damaged state is refused with a clear message, never taken for a fresh start; versions are write-once;
`nightshift doctor` checks the ledger, the registry and `current` against each other."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from jobs.store.files import DamagedState, sha256_file
from jobs.store.ledger import Ledger
from jobs.store.schema import LATEST, SCHEMA
from tests.conftest import REPO, alpaca, hang_bound, run, write_jsonl
from tests.store.test_adapters import craft


def ledger_of(cfg):
    return Ledger(cfg.state_dir / "ledger.sqlite")


def first_night(night_env, n=10):
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(n)])
    cfg = make(eval={"max_regression_increase_pct": None})  # every candidate passes: lineage is under test
    s = run(cfg, night="n1")
    assert s["outcome"] == "succeeded" and s["promoted"], s["error"]
    return inbox, cfg


def digests(path):
    return {p.name: sha256_file(p) for p in sorted(path.iterdir())}


# ---- the ledger ---------------------------------------------------------------------------------------


def test_an_empty_ledger_next_to_published_versions_is_refused(night_env):
    inbox, cfg = first_night(night_env)
    v1 = cfg.state_dir / "adapters" / "tiny-v0001"
    before = digests(v1)
    for suffix in ("", "-wal", "-shm"):
        p = cfg.state_dir / f"ledger.sqlite{suffix}"
        if p.exists():
            p.write_bytes(b"")
    write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(5)])
    with pytest.raises(DamagedState, match="refusing to start afresh"):
        run(cfg, night="n2")
    assert digests(v1) == before and sorted(p.name for p in (cfg.state_dir / "adapters").iterdir()) == ["tiny-v0001"]


def test_a_ledger_that_is_not_sqlite_is_refused_with_a_clear_message(tmp_path):
    (tmp_path / "ledger.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(DamagedState, match="not a readable nightshift ledger"):
        Ledger(tmp_path / "ledger.sqlite")


def test_the_ledger_carries_a_schema_version_and_old_ledgers_are_migrated(tmp_path):
    old = sqlite3.connect(tmp_path / "ledger.sqlite")  # a ledger from before versioning
    old.executescript(SCHEMA)
    old.execute("INSERT INTO files (source, path, size, mtime, sha256, seen_at) VALUES ('s', 'a', 1, 1, 'h', 1)")
    old.commit()
    old.close()
    led = Ledger(tmp_path / "ledger.sqlite")
    assert led.db.execute("PRAGMA user_version").fetchone()[0] == LATEST
    assert [r["path"] for r in led.db.execute("SELECT path, stat_key FROM files")] == ["a"]  # kept, new column
    led.db.execute(f"PRAGMA user_version={LATEST + 1}")
    led.close()
    with pytest.raises(DamagedState, match="newer than this nightshift"):
        Ledger(tmp_path / "ledger.sqlite")


def test_a_ledger_older_than_the_registry_is_refused(night_env):
    inbox, cfg = first_night(night_env)
    backup = cfg.state_dir.parent / "ledger-backup.sqlite"
    src = sqlite3.connect(cfg.state_dir / "ledger.sqlite")
    src.backup(dst := sqlite3.connect(backup))
    src.close()
    dst.close()
    write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(10)])
    assert run(cfg, night="n2")["version"] == 2
    v2 = cfg.state_dir / "adapters" / "tiny-v0002"
    before = digests(v2)
    for suffix in ("-wal", "-shm"):
        (cfg.state_dir / f"ledger.sqlite{suffix}").unlink(missing_ok=True)
    os.replace(backup, cfg.state_dir / "ledger.sqlite")  # "restored from last week's backup"
    write_jsonl(inbox / "c.jsonl", [alpaca(i, "?") for i in range(10)])
    s = run(cfg, night="n3")
    assert s["outcome"] == "failed" and "tiny-v0002" in s["error"] and "does not know" in s["error"]
    assert digests(v2) == before  # not deleted, not rewritten


# ---- `current` and the lineage ------------------------------------------------------------------------


def test_a_deleted_current_falls_back_to_the_ledgers_version_in_service(night_env):
    inbox, cfg = first_night(night_env)
    (cfg.state_dir / "current").unlink()
    write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(10)])
    s = run(cfg, night="n2")
    assert s["outcome"] == "succeeded" and s["parent_version"] == 1  # continued from v1, not from scratch
    manifest = json.loads((cfg.state_dir / "adapters" / "tiny-v0002" / "manifest.json").read_text())
    assert manifest["parent_version"] == 1
    assert (cfg.state_dir / "current").resolve().name == "tiny-v0002"


def test_a_dangling_current_refuses_the_night(night_env):
    import shutil

    inbox, cfg = first_night(night_env)
    shutil.rmtree(cfg.state_dir / "adapters" / "tiny-v0001")  # a careless operator
    write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(10)])
    s = run(cfg, night="n2")
    assert s["outcome"] == "failed" and "tiny-v0001 is not on disk" in s["error"]
    assert s["trained_samples"] == 0 and ledger_of(cfg).sample_counts() == {"trained": 9, "heldout": 1}
    assert not (cfg.state_dir / "adapters" / "tiny-v0002").exists()  # refused before it pulled or trained


def test_a_tampered_adapter_in_service_is_never_continued_from(night_env):
    inbox, cfg = first_night(night_env)
    f = cfg.state_dir / "adapters" / "tiny-v0001" / "adapter_model.safetensors"
    f.chmod(0o640)
    with open(f, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\x01\x02\x03")
    write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(10)])
    s = run(cfg, night="n2")
    assert s["outcome"] == "failed" and "integrity" in s["error"] and "sha256" in s["error"]
    assert s["trained_samples"] == 0 and not (cfg.state_dir / "adapters" / "tiny-v0002").exists()


# ---- write-once versions ------------------------------------------------------------------------------


def test_published_versions_are_sealed_group_readable_and_read_only(night_env):
    _, cfg = first_night(night_env)
    v1 = cfg.state_dir / "adapters" / "tiny-v0001"
    assert (v1.stat().st_mode & 0o777) == 0o750 and ((cfg.state_dir / "adapters").stat().st_mode & 0o777) == 0o750
    assert {p.name: p.stat().st_mode & 0o777 for p in v1.iterdir()} == {p.name: 0o440 for p in v1.iterdir()}


def test_a_version_published_by_someone_else_meanwhile_is_never_replaced(night_env, monkeypatch):
    """The race of two nights on one state directory, forced: another process publishes our number
    between our plan and our publish. Ours is refused; theirs stays whole."""
    import jobs.night.run as night_run
    from jobs.store.registry import Registry

    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    cfg = make()
    real_judge = night_run.judge

    def someone_else_publishes(ctx, *args):
        reg = Registry(cfg.state_dir)
        tmp = reg.new_tmp_dir("theirs")
        (tmp / "adapter_model.safetensors").write_bytes(b"their weights")
        reg.publish(tmp, "tiny", 1, {"version": 1})
        ctx.ledger.db.execute("UPDATE versions SET status='promoted', run_id='their-run' WHERE version=1")
        return real_judge(ctx, *args)

    monkeypatch.setattr(night_run, "judge", someone_else_publishes)
    s = run(cfg, night="n1")
    assert s["outcome"] == "failed" and "write-once" in s["error"]
    theirs = cfg.state_dir / "adapters" / "tiny-v0001" / "adapter_model.safetensors"
    assert theirs.read_bytes() == b"their weights"


# ---- nightshift doctor ----------------------------------------------------------------------------------


def doctor(tmp_path, state, *args):
    cfg = tmp_path / "doctor.toml"
    cfg.write_text(f'state_dir = "{state}"\n[model]\npath = "/models/none"\nname = "tiny"\n')
    return subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "doctor", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=hang_bound(120))


def test_doctor_finds_every_inconsistency_and_says_how_to_repair_it(tmp_path):
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    r = doctor(tmp_path, state)
    assert r.returncode == 0 and "no problems found" in r.stdout, r.stdout + r.stderr
    f = state / "adapters" / "tiny-v0001" / "adapter_model.safetensors"
    f.chmod(0o640)
    f.write_bytes(b"altered")
    (state / "current").unlink()
    (state / "adapters" / "tiny-v0009").mkdir()
    r = doctor(tmp_path, state, "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    problems = {(x["subject"], x["text"].split(":")[0]): x["fix"]
                for x in report["findings"] if x["level"] == "problem"}
    assert not report["ok"] and len(problems) == 3, problems
    assert any("tiny-v0001" in t and "restore" in fix for (_, t), fix in problems.items())
    assert any(s == "current" and "promote tiny-v0002" in fix for (s, _), fix in problems.items())
    assert any("tiny-v0009" in t for (_, t) in problems)
    assert not (state / "current").exists()  # read-only: nothing repaired behind the operator's back


def test_doctor_on_a_truncated_ledger_explains_instead_of_failing(tmp_path):
    state = tmp_path / "state"
    craft(state, 1)
    (state / "ledger.sqlite").write_bytes(b"")
    for suffix in ("-wal", "-shm"):
        (state / f"ledger.sqlite{suffix}").unlink(missing_ok=True)
    r = doctor(tmp_path, state)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "empty but the registry holds 1 version(s)" in r.stdout and "restore the ledger" in r.stdout
