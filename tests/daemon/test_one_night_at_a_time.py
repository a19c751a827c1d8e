"""One night at a time per state directory, with real processes: a second writer waits or exits with
status 5 (busy) and a message naming the holder; nothing is trained twice, no version is touched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.contract import ExitCode, crashpoints
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock, night_lock
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl
from tests.fixtures.daemon_proc import child_pids, runs, start, wait_for, write_config
from tests.store.test_adapters import craft

pytestmark = pytest.mark.slow
LONG_WINDOW = """
[window]
start = "00:00"
end = "12:00"
save_margin_minutes = 0.1
min_run_minutes = 0.1
"""  # `once` trains until now + the window's length: twelve hours, so a busy machine's night reaches its first step
HOLD = {crashpoints.ENV: "train.counted", crashpoints.ENV_HOW: "stop"}
"""A night given this environment stops itself once its first step is counted (jobs/contract/crashpoints.py): it
holds the night lock and its open run until the test kills it. The night is held open by an event, not timed
(a two-minute window with 1000 epochs had ended, at load ~20, before the test's second `once` started)."""


def stopped(pid):
    """The process stopped itself (state T in /proc/PID/stat): held at its crash point."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def nightshift(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=hang_bound(timeout), env={**os.environ, **(env or {})})


def popen_once(cfg, env=None):
    """`once` with its stderr drained into `proc.lines`, all of it there once its exit is seen."""
    return start(cfg, env=env, command="once")


def kill(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_two_onces_one_runs_the_other_exits_busy_and_the_lock_outlives_a_killed_supervisor(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model, epochs=3, more=LONG_WINDOW)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    a, b = popen_once(cfg, HOLD), popen_once(cfg, HOLD)  # started together
    wait_for(lambda: a.poll() is not None or b.poll() is not None, 90, "one of them to give way")
    loser, winner = (a, b) if a.poll() is not None else (b, a)
    loser.wait()
    err = "".join(loser.lines)
    assert loser.returncode == ExitCode.BUSY, err
    assert "held by another nightshift process" in err and "nightshift once" in err and "Traceback" not in err
    wait_for(lambda: child_pids(winner), 90, "the winner's night to start", winner)
    child = child_pids(winner)[0]
    try:
        wait_for(lambda: stopped(child), 90, "the winner's night to hold at its first step", winner)
        assert len(runs(tmp_path / "state")) == 1
        winner.kill()  # kill -9 of the supervisor: its child lives on, and keeps the state directory
        winner.wait()
        r = nightshift("--config", str(cfg), "once")  # without HOLD: were it let in, it would run a night
        assert r.returncode == ExitCode.BUSY, r.stderr[-2000:]
        assert f"pid {winner.pid}" in r.stderr  # who holds it, as the lock file says
    finally:
        kill(winner.pid)
        kill(child)
    wait_for(lambda: _free(tmp_path / "state"), 30, "the lock to be released with the last holder")
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    assert len(led.last_runs()) == 1 and "trained" not in led.sample_counts()  # one night, nothing trained twice
    # held after its first step: the version its plan reserved is still training, nothing was published
    assert [v["status"] for v in led.versions()] == ["training"]
    assert not list((tmp_path / "state" / "adapters").iterdir())


def _free(state):
    try:
        with night_lock(state, timeout=0):
            return True
    except Exception:
        return False


def test_once_while_the_service_runs_its_night_exits_busy(tmp_path, tiny_model):
    """The service's night is held at its first step (HOLD) while `once` tries, then let go and stopped."""
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, lasts=3600, epochs=3)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    daemon = start(cfg, env=HOLD)
    child = None
    try:
        wait_for(lambda: child_pids(daemon), 90, "the service's night", daemon)
        child = child_pids(daemon)[0]
        wait_for(lambda: stopped(child), 90, "the service's night to hold at its first step", daemon)
        r = nightshift("--config", str(cfg), "once")
        assert r.returncode == ExitCode.BUSY, r.stderr[-2000:]
        assert "nightshift run: night" in r.stderr and "Traceback" not in r.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)  # passed on to the night, which saves and stops once it goes on
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        daemon.wait(timeout=hang_bound(120))
    [run] = runs(tmp_path / "state")
    assert not run["night"].startswith("manual")  # the service's night only: `once` never opened one
    assert [v["status"] for v in Ledger(tmp_path / "state" / "ledger.sqlite").versions()] in ([], ["training"])


def test_the_service_waits_for_a_night_held_elsewhere_then_runs_it(tmp_path, tiny_model):
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, lasts=300)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    state = tmp_path / "state"
    held = night_lock(state, what="nightshift once").__enter__()
    daemon = start(cfg)
    try:
        wait_for(lambda: any('"night_waiting_for_lock"' in x for x in daemon.lines), 60, "the wait", daemon)
        assert not child_pids(daemon)
        held.__exit__(None, None, None)
        wait_for(lambda: any(r["status"] in ("succeeded", "rejected") for r in runs(state)), 180, "the night",
                 daemon)
    finally:
        held.__exit__(None, None, None)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=hang_bound(120))
    assert len(runs(state)) == 1


def test_a_second_service_on_the_same_state_directory_exits_busy(tmp_path, tiny_model):
    cfg, _ = write_config(tmp_path, tiny_model, opens_in=3600)
    first = start(cfg)
    try:
        wait_for(lambda: any('"status"' in x for x in first.lines), 60, "the first service to be up", first)
        r = nightshift("--config", str(cfg), "run", timeout=60)
        assert r.returncode == ExitCode.BUSY and "already runs" in r.stderr, r.stderr[-2000:]
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=hang_bound(60))


def test_once_and_calibrate_exit_busy_or_wait_as_configured_and_plan_reads_meanwhile(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)  # an empty inbox: a night would be over at once
    state = tmp_path / "state"
    with night_lock(state, what="nightshift run: night 2026-11-23"):
        for cmd in ("once", "calibrate"):
            r = nightshift("--config", str(cfg), cmd)
            assert r.returncode == ExitCode.BUSY, (cmd, r.stderr[-2000:])
            assert "nightshift run: night 2026-11-23" in r.stderr and "Traceback" not in r.stderr
            assert "(not waiting for " in r.stderr  # gave up at its first try (the default), not after a wait
        r = nightshift("--config", str(cfg), "plan", "--json")  # read-only: no lock needed
        assert r.returncode == 0 and json.loads(r.stdout)["train_ids"] == [], r.stderr[-2000:]
    held = night_lock(state, what="nightshift once").__enter__()
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NIGHTSHIFT_DAEMON__LOCK_WAIT_SECONDS": "3600"})
    try:  # released once `once` has the state directory open to lock it (it cannot get further while held)
        wait_for(lambda: _opened(proc.pid, state), 60, "`once` to wait for the night lock", proc)
    finally:
        held.__exit__(None, None, None)
    err = proc.communicate(timeout=hang_bound(120))[1]
    assert proc.returncode == 0, err[-2000:]


def _opened(pid, path):
    """`pid` has `path` open (the night lock is taken on the state directory itself)."""
    with contextlib.suppress(OSError):
        return any(os.readlink(f) == str(path) for f in Path(f"/proc/{pid}/fd").iterdir())
    return False


def test_registry_commands_wait_for_the_registry_lock_then_exit_busy(tmp_path):
    state = tmp_path / "state"
    craft(state, 1)
    cfg = tmp_path / "n.toml"
    cfg.write_text(f'state_dir = "{state}"\n[model]\npath = "/m"\nname = "tiny"\n'
                   "[registry]\nlock_timeout_seconds = 1\n")
    with StateLock(state / "lock", what="publish"):
        r = nightshift("--config", str(cfg), "adapters", "pin", "1")
    assert r.returncode == ExitCode.BUSY and "held by another nightshift process" in r.stderr, r.stderr
    assert nightshift("--config", str(cfg), "adapters", "pin", "1").returncode == 0
