"""Clean up after failure: checkpoints are kept for the resume and go when their run closes; a failed
night burns no version number; a damaged checkpoint falls back to the previous one (or to the run's start)."""

from __future__ import annotations

import json
import threading

import jobs.training.loop as loop_mod
from jobs.store.ledger import Ledger
from jobs.store.outcomes import NightOutcomes
from tests.conftest import alpaca, run, write_jsonl


def interrupted_night(night_env, *, saves_before_stop: int, n: int = 24, night: str = "n1"):
    """A night stopped (as by SIGTERM) after `saves_before_stop` checkpoints: its run stays open."""
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(n)])
    cfg = make(plan={"heldout_share": 0}, train={"batch_size": 4, "epochs": 3, "checkpoint_every_seconds": 0.001},
               eval={"max_regression_increase_pct": None})
    stop, saves, real_save = threading.Event(), [], loop_mod.save_checkpoint

    def counting_save(*a, **k):
        real_save(*a, **k)
        saves.append(1)
        if len(saves) >= saves_before_stop:
            stop.set()

    loop_mod.save_checkpoint = counting_save
    try:
        s = run(cfg, night=night, stop=stop)
    finally:
        loop_mod.save_checkpoint = real_save
    assert s["outcome"] == "interrupted", s["error"]
    return cfg, s


def test_the_checkpoints_of_a_run_closed_as_failed_are_removed(night_env):
    cfg, s = interrupted_night(night_env, saves_before_stop=2)
    ckpt = cfg.state_dir / "checkpoints" / s["run_id"]
    assert (ckpt / "latest" / "state.json").exists()  # kept for the resume while the run is open
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    NightOutcomes(led).close("n1", "failed", "3 attempts failed")  # the supervisor gives up on the night
    assert not ckpt.exists()


def test_checkpoints_left_by_runs_closed_elsewhere_are_swept_at_the_next_night(night_env):
    cfg, s = interrupted_night(night_env, saves_before_stop=2)
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    led.finish_run(s["run_id"], "failed", error="closed by an older release")  # no cleanup then
    (cfg.state_dir / "checkpoints" / "some-unknown-run").mkdir()
    run(cfg, night="n2")
    assert not (cfg.state_dir / "checkpoints").exists() or not list((cfg.state_dir / "checkpoints").iterdir())


def test_a_failed_night_burns_no_version_number(night_env):
    cfg, s = interrupted_night(night_env, saves_before_stop=1)
    assert s["version"] == 1
    NightOutcomes(Ledger(cfg.state_dir / "ledger.sqlite")).close("n1", "failed", "the window ended")
    # a fresh night plans its saves' time in (night 1 saved after every step: on a busy machine that plan fits
    # nothing and the night is skipped); this test is about the version number, so night 2 saves as shipped
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"checkpoint_every_seconds": 600})})
    s2 = run(cfg, night="n2")
    assert s2["outcome"] == "succeeded" and s2["version_name"] == "tiny-v0001", s2["error"]
    assert (cfg.state_dir / "current").resolve().name == "tiny-v0001"
    assert [r["version"] for r in Ledger(cfg.state_dir / "ledger.sqlite").versions()] == [1]


def _corrupt(path):
    f = path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(night_env):
    cfg, s = interrupted_night(night_env, saves_before_stop=3)
    ckpt = cfg.state_dir / "checkpoints" / s["run_id"]
    previous = json.loads((ckpt / "previous" / "state.json").read_text())["next_batch"]
    assert previous > 0
    _corrupt(ckpt / "latest")  # a disk error, a truncated write
    s2 = run(cfg, night="n1")
    assert s2["run_id"] == s["run_id"] and s2["outcome"] == "succeeded", s2["error"]
    training = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())["training"]
    assert training["resumed_from_step"] == previous
    assert training["steps"] == training["batches"] >= 6  # every batch exactly once over both attempts
    assert not ckpt.exists()


def test_with_no_usable_checkpoint_the_run_restarts_from_its_parent(night_env):
    cfg, s = interrupted_night(night_env, saves_before_stop=3)
    ckpt = cfg.state_dir / "checkpoints" / s["run_id"]
    _corrupt(ckpt / "latest")
    _corrupt(ckpt / "previous")
    s2 = run(cfg, night="n1")
    assert s2["outcome"] == "succeeded", s2["error"]
    training = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())["training"]
    assert training["resumed_from_step"] == 0 and training["steps"] == training["batches"]
    assert Ledger(cfg.state_dir / "ledger.sqlite").sample_counts() == {"trained": 24}


def test_a_resumed_night_shows_its_new_time_with_the_samples_it_planned(night_env):
    """Resumed with a new --until, the night's plan keeps its samples and version but shows the time left now,
    not the first start's (issue 42: "time available 17,067 s" printed for a 40-minute window)."""
    cfg, first = interrupted_night(night_env, saves_before_stop=2)
    events: list[dict] = []
    s = run(cfg, night="n1", seconds=600, events=events)
    [plan] = [e["plan"] for e in events if e["event"] == "plan"]
    assert plan["train_ids"] == first["plan"]["train_ids"] and plan["version"] == first["plan"]["version"]
    assert plan["available_seconds"] <= 600 < first["plan"]["available_seconds"] and "resumed" in plan["basis"]
    assert s["outcome"] == "succeeded"
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    kinds = [r[0] for r in led.db.execute("SELECT kind FROM events WHERE run_id=? ORDER BY id", (s["run_id"],))]
    assert kinds[:2] == ["interrupted", "resumed"]
