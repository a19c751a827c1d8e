"""`nightshift calibrate` with `[train] objective = "dpo"` measures the preference night's own step (packed pairs,
the reference forward, the DPO step) and records it under the DPO throughput key; the plan of a DPO night then
divides by that figure. On the CPU: the GPU-only parts (unsloth's loader, torch.cuda's memory counters, NVML)
are faked; the steps timed are the real DPO steps of the tiny model."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.conftest import write_jsonl

torch = pytest.importorskip("torch")

GB = 1e9


def pair(i: int) -> dict[str, str]:
    return {"prompt": f"Add {i} and {i + 1}.", "chosen": f"{i} + {i + 1} = {2 * i + 1}", "rejected": "I do not know."}


@pytest.fixture()
def gpu_faked(monkeypatch):
    """The unsloth backend loaded as the hf one; a card whose memory grows 120 MB a token of a step (so the probe
    chooses a small step), and a counter of the steps calibrate ran through the preference objective."""
    from jobs.gpu import telemetry
    from jobs.training import load, probe
    from jobs.training.preference.probe import PairObjective

    monkeypatch.setattr(load, "resolve_backend", lambda cfg: "unsloth")
    monkeypatch.setattr(load, "_load_unsloth", lambda path, cfg, adapter, shape, cache_dir:
                        load._load_hf(path, cfg, adapter, shape))
    monkeypatch.setattr(telemetry, "free_vram_gb", lambda *a, **k: None)
    monkeypatch.setattr(probe, "PROCESS_WARMUP_SECONDS", 0.0)
    card = {"static": 1 * GB, "peak": 1 * GB, "dpo_steps": 0}
    step = PairObjective.step

    def dpo_step(self, model, batch, optimizer):
        card["dpo_steps"] += 1
        card["peak"] = max(card["peak"], card["static"] + 1.2e8 * batch.real_tokens)
        return step(self, model, batch, optimizer)

    monkeypatch.setattr(PairObjective, "step", dpo_step)
    for name, fn in {"synchronize": lambda *a: None, "empty_cache": lambda: None,
                     "reset_peak_memory_stats": lambda *a: card.update(peak=card["static"]),
                     "memory_reserved": lambda *a: card["static"], "memory_allocated": lambda *a: card["static"],
                     "max_memory_reserved": lambda *a: card["peak"], "max_memory_allocated": lambda *a: card["peak"]
                     }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return card


def test_calibrate_measures_the_dpo_step_under_its_key_and_the_plan_uses_that_figure(night_env, tmp_path,
                                                                                      gpu_faked):
    from jobs.contract import ExitCode
    from jobs.night.calibrate import main
    from jobs.night.model import model_fingerprint, throughput_key
    from jobs.night.run import run_night
    from jobs.store.ledger import Ledger

    inbox, make = night_env
    write_jsonl(inbox / "prefs.jsonl", [pair(i) for i in range(20)])
    cfg = make(train={"objective": "dpo", "batching": "packed", "max_seq_length": 128})
    path = tmp_path / "night.json"
    (tmp_path / "state").mkdir()  # `nightshift calibrate` makes it before it starts the measuring child
    path.write_text(cfg.model_dump_json())
    assert main(["--out", str(tmp_path / "out"), "--config", str(path), "--seconds", "1",
                 "--no-checkpointing-line"]) == ExitCode.OK
    assert gpu_faked["dpo_steps"] > 6  # the probe's and the timed steps were the preference night's
    doc = json.loads((tmp_path / "out" / "calibration.json").read_text())
    fp = model_fingerprint(cfg.model.path)
    dpo_key = throughput_key(cfg, fp, "unsloth", "cpu")
    sft_key = throughput_key(cfg.model_copy(update={"train": cfg.train.model_copy(update={"objective": "sft"})}),
                             fp, "unsloth", "cpu")
    assert doc["key"] == dpo_key != sft_key
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    try:
        assert led.calibration(dpo_key) is not None and led.calibration(sft_key) is None
    finally:
        led.close()
    rates = set(doc["tokens_per_second"].values())
    assert all(r > 0 for r in rates)
    s = run_night(cfg, night="2026-11-21", deadline=time.time() + 3600, emit=lambda ev: None,
                  stop=threading.Event(), plan_only=True).model_dump(mode="json")
    # calibrate's figure, not the prior (2,000); through the ledger it may come back one ulp off (45.81639340495135
    # against 45.81639340495134 in a whole run)
    assert any(s["plan"]["tokens_per_second"] == pytest.approx(r, rel=1e-12) for r in rates), (s["plan"], doc)
    assert "calibrate" in s["plan_basis"], s["plan_basis"]
