"""One night at a time per state directory, with real processes: a second writer waits or exits with
status 5 (busy) and a message naming the holder; nothing is trained twice, no version is touched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jobs.contract import ExitCode
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock, night_lock
from tests.conftest import REPO, alpaca, toml_config, write_jsonl
from tests.fixtures.daemon_proc import child_pids, runs, start, wait_for, write_config
from tests.store.test_adapters import craft

pytestmark = pytest.mark.slow
SHORT_WINDOW = """
[window]
start = "00:00"
end = "00:02"
save_margin_minutes = 0.1
min_run_minutes = 0.1
"""  # `once` trains until now + the window's length: two minutes at most, whatever happens


def nightshift(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def popen_once(cfg):
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.lines = []
    threading.Thread(target=lambda: proc.lines.extend(proc.stderr), daemon=True).start()
    return proc


def kill(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_two_onces_one_runs_the_other_exits_busy_and_the_lock_outlives_a_killed_supervisor(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model, epochs=1000, more=SHORT_WINDOW)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    a, b = popen_once(cfg), popen_once(cfg)  # started together
    wait_for(lambda: a.poll() is not None or b.poll() is not None, 90, "one of them to give way")
    loser, winner = (a, b) if a.poll() is not None else (b, a)
    loser.wait()
    err = "".join(loser.lines)
    assert loser.returncode == ExitCode.BUSY, err
    assert "held by another nightshift process" in err and "nightshift once" in err and "Traceback" not in err
    wait_for(lambda: child_pids(winner), 90, "the winner's night to start", winner)
    child = child_pids(winner)[0]
    wait_for(lambda: (tmp_path / "state" / "ledger.sqlite").exists() and runs(tmp_path / "state"), 90,
             "the winner's run to open", winner)
    winner.kill()  # kill -9 of the supervisor: its child goes on, and keeps the state directory
    winner.wait()
    try:
        r = nightshift("--config", str(cfg), "once")
        assert r.returncode == ExitCode.BUSY, r.stderr[-2000:]
        assert f"pid {winner.pid}" in r.stderr  # who holds it, as the lock file says
    finally:
        kill(child)
    wait_for(lambda: _free(tmp_path / "state"), 30, "the lock to be released with the last holder")
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    assert len(led.last_runs()) == 1 and "trained" not in led.sample_counts()  # one night, nothing trained twice
    assert led.versions() == [] and not list((tmp_path / "state" / "adapters").iterdir())


def _free(state):
    try:
        with night_lock(state, timeout=0):
            return True
    except Exception:
        return False


def test_once_while_the_service_runs_its_night_exits_busy(tmp_path, tiny_model):
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, lasts=120, epochs=1000)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    daemon = start(cfg)
    try:
        wait_for(lambda: child_pids(daemon), 90, "the service's night", daemon)
        r = nightshift("--config", str(cfg), "once")
        assert r.returncode == ExitCode.BUSY, r.stderr[-2000:]
        assert "nightshift run: night" in r.stderr and "Traceback" not in r.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
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
        daemon.wait(timeout=120)
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
        first.wait(timeout=60)


def test_once_and_calibrate_exit_busy_or_wait_as_configured_and_plan_reads_meanwhile(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)  # an empty inbox: a night would be over at once
    state = tmp_path / "state"
    with night_lock(state, what="nightshift run: night 2026-11-23"):
        for cmd in ("once", "calibrate"):
            t0 = time.time()
            r = nightshift("--config", str(cfg), cmd)
            assert r.returncode == ExitCode.BUSY, (cmd, r.stderr[-2000:])
            assert "nightshift run: night 2026-11-23" in r.stderr and "Traceback" not in r.stderr
            assert time.time() - t0 < 60
        r = nightshift("--config", str(cfg), "plan", "--json")  # read-only: no lock needed
        assert r.returncode == 0 and json.loads(r.stdout)["train_ids"] == [], r.stderr[-2000:]
    held = night_lock(state, what="nightshift once").__enter__()
    threading.Timer(3.0, lambda: held.__exit__(None, None, None)).start()
    r = nightshift("--config", str(cfg), "once", env={"NIGHTSHIFT_DAEMON__LOCK_WAIT_SECONDS": "120"})
    assert r.returncode == 0, r.stderr[-2000:]


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
