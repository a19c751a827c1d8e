"""Whole nights on several ranks (`[train] gpus = 2` on a CPU host: 2 processes over gloo, through torchrun),
driven through the CLI as an operator would. The daemon's retry after a dead rank: tests/daemon/test_ranks.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from daemon.settings import load_settings
from jobs.store.ledger import Ledger
from tests.conftest import REPO, alpaca, hang_bound, run, toml_config, write_jsonl
from tests.fixtures.ports import reserved_port

pytestmark = pytest.mark.slow
ENV = {"OMP_NUM_THREADS": "1"}  # 2 cores, 2 ranks


def nightshift(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=hang_bound(timeout), env={**os.environ, **ENV, **(env or {})})


def adapter(state):
    from safetensors.torch import load_file

    return load_file(state / "current" / "adapter_model.safetensors")


def manifest(state):
    return json.loads((state / "current" / "manifest.json").read_text())


def test_two_ranks_publish_the_adapter_one_process_trains_with_the_same_global_batch(tmp_path, tiny_model):
    """2 ranks x 3 samples per step against 1 process x 6: samples of different lengths, so each rank's share
    has its own token count and only a token-weighted reduction gives the same step. The night is unmeasured:
    its two probe steps are split one row per rank (the same global probe steps as one process's). Batches of
    3 so that every epoch's rows pair up into one process's batches of 6 (a global step takes consecutive rows:
    an odd count would pair an epoch's last row with the next epoch's first)."""
    records = [alpaca(i) for i in range(40)]
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    two, inbox = toml_config(tmp_path / "two", tiny_model, gpus=2, batch_size=3, epochs=2, learning_rate=1e-3)
    write_jsonl(inbox / "a.jsonl", records)
    r = nightshift("--config", str(two), "once")
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("outcome ") == 1  # rank 0 alone reports: one plan, one summary
    one, inbox = toml_config(tmp_path / "one", tiny_model, gpus=1, batch_size=6, epochs=2, learning_rate=1e-3)
    write_jsonl(inbox / "a.jsonl", records)
    s1 = run(load_settings(one).night_config())
    assert s1["outcome"] == "succeeded", s1["error"]

    a2, a1 = adapter(tmp_path / "two" / "state"), adapter(tmp_path / "one" / "state")
    assert a2.keys() == a1.keys()
    diff = max(float((a2[k] - a1[k]).abs().max()) for k in a1)
    moved = max(float(a1[k].abs().max()) for k in a1 if "lora_B" in k)  # lora_B starts at 0
    assert diff < 1e-5 and moved > 1e-3, (diff, moved)  # measured: 1.7e-7 (float32 summation order), 8e-3
    m2, m1 = manifest(tmp_path / "two" / "state"), manifest(tmp_path / "one" / "state")
    assert m2["training"]["world_size"] == 2 and m1["training"]["world_size"] == 1
    probes = m1["training"]["probe_samples"]
    assert len(probes) == 2 and m2["training"]["probe_samples"] == [p - p // 2 if k % 2 == 0 else p // 2
                                                                    for p in probes for k in range(2)]
    # two probe steps, the first epoch's other samples and then all 40, 6 per step
    assert m2["training"]["steps"] == m1["training"]["steps"] == 2 + -(-(40 - sum(probes)) // 6) + -(-40 // 6)
    assert abs(m2["losses"]["train"] - m1["losses"]["train"]) < 1e-5
    led = Ledger(tmp_path / "two" / "state" / "ledger.sqlite")
    assert led.sample_counts() == {"trained": 40}
    [key] = [r["key"] for r in led.db.execute("SELECT DISTINCT key FROM throughput")]
    one_key = Ledger(tmp_path / "one" / "state" / "ledger.sqlite").db.execute("SELECT key FROM throughput")
    assert key != one_key.fetchone()["key"]  # measured per count: 2 ranks plan 2-rank nights only


def test_sigterm_reaches_every_rank_and_the_checkpoint_holds_the_global_position(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model, gpus=2, batch_size=4, epochs=20, checkpoint_every_seconds=0.5)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(24)])
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    end = time.monotonic() + hang_bound(180)
    while not list(state.glob("checkpoints/*/latest/state.json")):  # training, and not finished
        assert time.monotonic() < end and proc.poll() is None, "no checkpoint appeared: " + "".join(lines[-20:])
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as Ctrl-C or `systemctl stop`: the CLI stops its child group
    out = proc.stdout.read()
    proc.wait(timeout=hang_bound(120))
    reader.join(timeout=hang_bound(30))
    assert proc.returncode == 3, "".join(lines[-40:])  # interrupted: the run stays open
    assert "interrupted" in out
    [ckpt] = state.glob("checkpoints/*/latest/state.json")
    position = json.loads(ckpt.read_text())
    assert position["next_batch"] == 2 * position["steps"] > 0  # both ranks' rows: the global position
    stopped = [x for x in lines if '"rank_done"' in x]
    assert stopped and json.loads(stopped[0])["stopped"] == "signal"  # rank 1 stopped by the same decision
    assert json.loads(stopped[0])["next_batch"] == position["next_batch"]

    r = nightshift("--config", str(cfg), "once")
    assert r.returncode == 0, r.stderr[-4000:]
    m = manifest(state)
    assert m["training"]["resumed_from_step"] == position["next_batch"]
    assert m["training"]["steps"] == 20 * 6 // 2  # every global step exactly once over both attempts
    assert Ledger(state / "ledger.sqlite").sample_counts() == {"trained": 24}


def test_two_local_hosts_rendezvous_over_loopback_and_node_0_owns_the_night(tmp_path, tiny_model):
    # held until node 0's rendezvous store binds it (tests/fixtures/ports.py)
    with reserved_port() as port:
        cfgs = []
        for node in (0, 1):
            (tmp_path / f"host{node}").mkdir()
            cfg, _ = toml_config(tmp_path / f"host{node}", tiny_model, batch_size=4, more=f"""
[train.distributed]
nnodes = 2
node_rank = {node}
rdzv_endpoint = "127.0.0.1:{port}"
join_timeout_seconds = 120
""")
            cfgs.append(cfg)
        write_jsonl(tmp_path / "host0" / "inbox" / "a.jsonl", [alpaca(i) for i in range(24)])
        refused = nightshift("--config", str(cfgs[1]), "once")
        assert refused.returncode == 2 and "nightshift join" in refused.stderr  # node 1 never runs a night itself
        joiner = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfgs[1]), "join", "--once"],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **ENV})
        try:
            r = nightshift("--config", str(cfgs[0]), "once")
            assert r.returncode == 0, r.stderr[-4000:]
            _, err = joiner.communicate(timeout=hang_bound(120))
        finally:
            joiner.kill()
    assert joiner.returncode == 0, err[-3000:]
    done = [json.loads(x) for x in err.splitlines() if '"rank_done"' in x]
    assert done and done[0]["rank"] == 1 and done[0]["steps"] == 3  # 6 rows, 2 per step
    m = manifest(tmp_path / "host0" / "state")
    assert m["training"]["world_size"] == 2 and m["training"]["steps"] == 3
    assert Ledger(tmp_path / "host0" / "state" / "ledger.sqlite").sample_counts() == {"trained": 24}
    host1 = tmp_path / "host1" / "state"
    assert not (host1 / "ledger.sqlite").exists() and not (host1 / "adapters").exists()  # node 0 owns it all
