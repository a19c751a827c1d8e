"""Issue 40: deleting the lock file does not let a second night in beside the first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jobs.contract import ExitCode
from jobs.store.locking import LockTimeout, night_lock
from jobs.store.paths import StatePaths
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl


def test_the_night_lock_holds_when_its_file_is_deleted(tmp_path):
    state = tmp_path / "state"
    with night_lock(state, what="nightshift once"):
        StatePaths(state).night_lock.unlink()  # `rm state/*.lock` while a night trains
        with pytest.raises(LockTimeout, match="held by another nightshift process"):
            night_lock(state, timeout=0, what="a second night").__enter__()
    with night_lock(state, timeout=0):  # released with its holder
        pass


@pytest.mark.slow
def test_once_exits_busy_while_another_process_holds_the_night_and_its_lock_file_is_gone(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jobs.store.locking import night_lock; "
         "night_lock(sys.argv[1], what='the first night').__enter__(); print('held', flush=True); time.sleep(600)",
         str(state)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for p in state.glob("*.lock"):
            p.unlink()
        r = subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                           capture_output=True, text=True, timeout=hang_bound(240), env=dict(os.environ))
        assert r.returncode == ExitCode.BUSY, r.stderr[-3000:]
        assert "held by another nightshift process" in r.stderr
    finally:
        holder.kill()
        holder.wait()
    from jobs.store.readonly import open_read_only

    led = open_read_only(state / "ledger.sqlite")
    assert led.last_runs() == [] and led.backlog()[0] == 0  # the second process opened no run, read nothing
