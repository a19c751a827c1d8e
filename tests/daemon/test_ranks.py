"""The service with `[train] gpus = 2` (2 CPU ranks over gloo): a dead rank fails the attempt cleanly and the
daemon's retry resumes the night from its checkpoint."""

import json
import os
import signal

import pytest

from jobs.store.ledger import Ledger
from tests.fixtures.daemon_proc import child_pids, runs, start, wait_for, write_config

pytestmark = pytest.mark.slow


def rank_pids(proc, rank):
    return [json.loads(x)["pid"] for x in list(proc.lines) if '"rank_started"' in x and f'"rank": {rank},' in x]


def test_kill_9_of_one_rank_fails_the_attempt_and_the_retry_trains_every_sample_once(tmp_path, tiny_model,
                                                                                     monkeypatch):
    from tests.conftest import alpaca, write_jsonl

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg, inbox = write_config(tmp_path, tiny_model, opens_in=1, gpus=2, epochs=20, batch_size=4,
                              checkpoint_every_seconds=0.5)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(24)])
    state = tmp_path / "state"
    proc = start(cfg)
    try:
        wait_for(lambda: rank_pids(proc, 1) and list(state.glob("checkpoints/*/latest/state.json")), 180,
                 "a checkpoint", proc)
        os.kill(rank_pids(proc, 1)[0], signal.SIGKILL)  # rank 1 only: rank 0 and torchrun live on
        wait_for(lambda: runs(state)[0]["status"] == "succeeded", 240, "the retried run to finish", proc)
        assert len(child_pids(proc)) == 2  # a second group, started by the daemon after the backoff
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    led = Ledger(state / "ledger.sqlite")
    rows = led.db.execute("SELECT detail FROM events WHERE kind='attempt_failed' ORDER BY id")
    [failure] = [json.loads(e["detail"]) for e in rows]
    assert "RuntimeError" in failure["error"]  # rank 0's collective failed at once: no hang, a clean failure
    manifest = json.loads((state / "current" / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] > 0 and manifest["training"]["world_size"] == 2
    assert manifest["training"]["steps"] == 20 * 6 // 2  # every global step exactly once over both attempts
    assert led.sample_counts() == {"trained": 24} and len(runs(state)) == 1


def test_a_torchrun_worker_sees_the_night_lock_its_launcher_holds(tmp_path):
    """The daemon hands the night lock to torchrun (pass_fds); torchrun does not pass descriptors on to its
    workers, so rank 0 checks its launcher's descriptor instead of taking the lock (which would be busy)."""
    import subprocess

    from jobs.store.locking import LOCK_FD_ENV, inherited_night_lock, night_lock

    with night_lock(tmp_path, what="test") as lock:
        env = {LOCK_FD_ENV: str(lock.fd)}
        assert inherited_night_lock(tmp_path, env, holder_pid=os.getpid())  # the holder's descriptor: ours
        other = subprocess.Popen(["sleep", "30"])  # a process without that descriptor
        try:
            assert not inherited_night_lock(tmp_path, env, holder_pid=other.pid)
        finally:
            other.kill()
            other.wait()
    assert not inherited_night_lock(tmp_path, env, holder_pid=os.getpid())  # closed: nobody holds it
