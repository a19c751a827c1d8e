"""`nightshift run` as systemd runs it: a real subprocess, a window seconds away, NOTIFY_SOCKET."""

import json
import os
import signal
import time

import pytest

from jobs.store.ledger import Ledger
from tests.conftest import alpaca, hang_bound, write_jsonl
from tests.fixtures.daemon_proc import Notify, child_pids, runs, start, wait_for, write_config

pytestmark = pytest.mark.slow


def counts(state):
    led = Ledger(state / "ledger.sqlite")
    try:
        return led.sample_counts()
    finally:
        led.close()


def restart_resumes_and_trains_every_batch_once(cfg, state, *, batches, samples):
    """Start the daemon again inside the window: it resumes the open run from its checkpoint."""
    proc = start(cfg)
    try:
        wait_for(lambda: runs(state)[0]["status"] == "succeeded", 240, "the resumed run to finish", proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=hang_bound(60))
    finally:
        proc.kill()
    manifest = json.loads((state / "current" / "manifest.json").read_text())
    training = manifest["training"]  # every batch once; the probe steps of an unmeasured night set their number
    assert training["resumed_from_step"] > 0 and training["steps"] == training["batches"] >= batches // 2
    c = counts(state)  # nothing lost, nothing twice (a loaded machine may cut whole samples: they stay pending)
    assert set(c) <= {"trained", "pending"} and sum(c.values()) == samples and c["trained"] > 0
    assert len(runs(state)) == 1


def test_one_night_in_the_window_with_systemd_notify_and_no_rerun_after_restart(tmp_path, tiny_model):
    opens_in = hang_bound(5)  # room for the daemon to start before the opening, stretched by the load
    opening = time.time() + opens_in
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=opens_in)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    state = tmp_path / "state"
    notify = Notify(tmp_path / "notify.sock")
    started = time.monotonic()
    proc = start(cfg, notify, watchdog_usec=1_000_000)
    try:
        wait_for(lambda: notify.having("READY=1"), 60, "READY=1", proc)
        # the window opens within [window] prewarm_seconds (90): the night's process starts now and waits
        wait_for(lambda: notify.having("STATUS=night"), 30, "the night's status", proc)
        if time.time() < opening - 1:  # seen before the opening: the night's process prepares (a busy box may be late)
            assert "preparing (the window opens" in notify.having("STATUS=night")[0]
        wait_for(lambda: any(r["status"] == "succeeded" for r in runs(state)), 120, "a succeeded run", proc)
        # nothing before the window opens (its start is `opening` to the second): read from the run, not from
        # when this test looked, which a busy box may make after the opening
        assert runs(state)[0]["started_at"] >= int(opening) - 0.01
        wait_for(lambda: any("next" in m for m in notify.having("STATUS=waiting")), 30, "waiting again", proc)
        time.sleep(2)
        assert len(runs(state)) == 1  # exactly one run in the window
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=hang_bound(60)) == 0
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
    notify.sync()  # what the daemon sent before it exited (STOPPING=1 last) is read
    statuses = notify.having("STATUS=")
    assert any(m.startswith("STATUS=training v0001:") for m in statuses), statuses
    # the log: the run id on every line of the night (the daemon's own too), few status lines
    logged = [json.loads(x) for x in proc.lines if x.startswith("{")]
    first = next(i for i, x in enumerate(logged) if x["event"] == "child_started")
    end = max(i for i, x in enumerate(logged) if x.get("run_id"))
    night = [x for x in logged[first:end + 1]  # the wake timer's own thread fires at the opening, mid-night now
             if not x["logger"].startswith(("apscheduler", "nightshift.scheduler"))]
    assert len(night) >= 5 and {x.get("run_id") for x in night} == {runs(state)[0]["id"]}
    assert len([x for x in logged if x["event"] == "status"]) <= 1 + elapsed / 60
    # WATCHDOG_USEC=1 s: a ping every 0.5 s, not at every 0.2 s tick of the supervisor
    assert 3 <= len(notify.having("WATCHDOG=1")) <= 2 * elapsed + 3
    assert notify.having("STOPPING=1")
    assert (state / "current").resolve().name == "tiny-v0001"

    # a restart inside the same window after the completed run does not run it again
    proc = start(cfg, notify)
    try:
        wait_for(lambda: len(notify.having("READY=1")) == 2, 60, "second READY=1", proc)
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=hang_bound(60)) == 0
    finally:
        proc.kill()
        notify.close()
    assert len(runs(state)) == 1


def test_sigterm_mid_training_saves_a_checkpoint_and_the_restart_resumes(tmp_path, tiny_model):
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, epochs=30, batch_size=4, checkpoint_every_seconds=600)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(24)])
    state = tmp_path / "state"
    proc = start(cfg)
    try:
        wait_for(lambda: list(state.glob("checkpoints/*/before.json")), 120, "training to start", proc)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)  # as `systemctl stop` does
        assert proc.wait(timeout=hang_bound(60)) == 0
    finally:
        proc.kill()
    [run] = runs(state)
    assert run["status"] == "running"  # open: the next start resumes it
    assert list(state.glob("checkpoints/*/latest/state.json")), "no checkpoint saved on SIGTERM"
    assert counts(state) == {"pending": 24}
    led = Ledger(state / "ledger.sqlite")
    try:  # the report shows it (issue 42): an interruption, then a resume
        assert led.db.execute("SELECT COUNT(*) FROM events WHERE kind='interrupted'").fetchone()[0] == 1
    finally:
        led.close()

    restart_resumes_and_trains_every_batch_once(cfg, state, batches=30 * 6, samples=24)


def test_kill_9_of_daemon_and_child_then_restart_trains_nothing_twice(tmp_path, tiny_model):
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, epochs=30, batch_size=4, checkpoint_every_seconds=0.5)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(24)])
    state = tmp_path / "state"
    proc = start(cfg)
    try:
        wait_for(lambda: child_pids(proc) and list(state.glob("checkpoints/*/latest/state.json")), 120,
                 "a checkpoint", proc)
        time.sleep(0.3)
        os.kill(child_pids(proc)[0], signal.SIGKILL)  # systemd's SIGKILL reaches the whole cgroup: both die
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert counts(state) == {"pending": 24}

    restart_resumes_and_trains_every_batch_once(cfg, state, batches=30 * 6, samples=24)


def test_a_crashed_child_is_recorded_and_retried_in_the_window(tmp_path, tiny_model):
    """kill -9 of the night's process only: the daemon lives on, records why, retries, resumes."""
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, epochs=30, batch_size=4,
                              checkpoint_every_seconds=0.5)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(24)])
    state = tmp_path / "state"
    proc = start(cfg)
    try:
        wait_for(lambda: child_pids(proc) and list(state.glob("checkpoints/*/latest/state.json")), 120,
                 "a checkpoint", proc)
        os.kill(child_pids(proc)[0], signal.SIGKILL)
        wait_for(lambda: runs(state)[0]["status"] == "succeeded", 240, "the retried run to finish", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=hang_bound(60)) == 0  # its log read to the end
    finally:
        proc.kill()
    assert len(child_pids(proc)) == 2  # a second child, started by the daemon after the backoff
    led = Ledger(state / "ledger.sqlite")
    rows = led.db.execute("SELECT detail FROM events WHERE kind='attempt_failed' ORDER BY id")
    [failure] = [json.loads(e["detail"]) for e in rows]
    assert "SIGKILL" in failure["error"] and failure["tail"]  # exit status and the last log lines
    # nothing lost, nothing twice: a slow (loaded) machine may cut whole samples before the window's end,
    # and those stay pending for the next night
    c = counts(state)
    assert set(c) <= {"trained", "pending"} and sum(c.values()) == 24 and c.get("trained", 0) > 0
    assert len(runs(state)) == 1


def test_a_night_that_keeps_failing_is_closed_after_max_attempts_and_the_daemon_lives(tmp_path, tiny_model):
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(5)])
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cfg.write_text(cfg.read_text().replace(str(tiny_model), str(broken)) + "max_attempts = 2\n")
    state = tmp_path / "state"
    proc = start(cfg)
    try:
        wait_for(lambda: (state / "ledger.sqlite").exists() and runs(state)
                 and runs(state)[-1]["status"] == "failed", 180, "the night to be closed as failed", proc)
        time.sleep(1)
        assert proc.poll() is None  # the daemon lives on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=hang_bound(60)) == 0
    finally:
        proc.kill()
    [run] = runs(state)
    assert run["status"] == "failed" and "2 attempts failed" in run["error"]
    assert not (state / "current").exists()
