"""A night and a calibration on 2 GPUs through the CLI (skipped without 2 cards and unsloth).

    python -m pytest tests/training/test_gpu_ranks.py -q -m gpu -s
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, SAMPLE_INBOX

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("unsloth") is None,
                       reason="needs 2 CUDA cards and unsloth"),
]



def config(tmp_path, model, gpus=2):
    inbox = tmp_path / "inbox"
    inbox.mkdir(exist_ok=True)
    shutil.copy(SAMPLE_INBOX / "alpaca-2026-11-20.jsonl", inbox / "a.jsonl")
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / "state"}"
[model]
path = "{model}"
name = "gpu"
[[sources]]
name = "inbox"
inbox = "{inbox}"
settle_seconds = 0
[plan]
prior_tokens_per_second = 5000
prior_overhead_seconds = 60
[train]
backend = "unsloth"
batching = "packed"
tokens_per_step = 4096
epochs = 2
gradient_checkpointing = false
max_seq_length = 512
gpus = {gpus}
[gpu]
max_vram_gb = 40
sample_hz = 5
""")
    return cfg


def nightshift(*args):
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=1200, env={**os.environ})


def test_a_night_on_two_gpus(small_model, tmp_path):
    cfg = config(tmp_path, small_model)
    r = nightshift("--config", str(cfg), "once")
    assert r.returncode == 0, r.stderr[-5000:]
    manifest = json.loads((tmp_path / "state" / "current" / "manifest.json").read_text())
    t = manifest["training"]
    assert t["world_size"] == 2 and t["backend"] == "unsloth" and t["tokens_per_step"] == 4096
    gpu = manifest["energy"]["gpu"]
    assert gpu["name"].startswith("2x ") and gpu["energy_joules"] > 0 and gpu["peak_reserved_bytes"] > 0
    ranks = [json.loads(x) for x in r.stderr.splitlines() if '"rank_started"' in x]
    assert sorted(x["device"] for x in ranks) == ["cuda:0", "cuda:1"] and {x["backend"] for x in ranks} == {"nccl"}
    print("2-GPU night:", json.dumps({k: t[k] for k in ("steps", "tokens_per_second", "seconds")}))


def test_calibrate_on_two_gpus_records_for_two(small_model, tmp_path):
    from jobs.night.config import NightConfig  # noqa: F401  (the key below is the night's)
    from jobs.store.ledger import Ledger

    cfg = config(tmp_path, small_model)
    r = nightshift("--config", str(cfg), "calibrate", "--seconds", "5")
    assert r.returncode == 0, r.stderr[-5000:]
    doc = json.loads((tmp_path / "state" / "calibrate" / "calibration.json").read_text())
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    [row] = led.db.execute("SELECT key, origin, tokens_per_second FROM throughput").fetchall()
    assert row["origin"] == "calibrate" and row["key"] == doc["key"]
    r = nightshift("--config", str(cfg), "plan", "--json")  # a plan for 2 cards uses the 2-card measurement
    plan = json.loads(r.stdout)
    assert "calibrate" in plan["basis"], plan["basis"]
    print("2-GPU calibration:", json.dumps(doc["tokens_per_second"]))
