"""The trl_liger stack (issue 44): TRL's SFTTrainer with Liger Kernel on HF + PEFT + bitsandbytes NF4, run as users
would (no Unsloth in its worker), with Liger's switch on, the LoRA through the trainer, a fresh base per window,
and half the rows after an out-of-memory. CPU: the loader and the trainer faked, the settings they get checked."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job


@pytest.fixture
def fake_liger(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))


def test_the_worker_runs_trl_liger_without_unsloth(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import benchmarks.stacks as stacks
    import jobs.training.backends.unsloth_import as ui
    import jobs.training.ranks.collectives as coll
    from benchmarks import cli

    ran: list[str] = []
    monkeypatch.setattr(ui, "import_unsloth", lambda **_: pytest.fail("Unsloth imported in the trl_liger worker"))
    monkeypatch.setattr(coll, "bind_device", lambda: None)
    monkeypatch.setattr(stacks, "worker", lambda name: lambda s, job: ran.append(job.stack))
    settings = tmp_path / "s.json"
    settings.write_text(BenchSettings(arch="llama3.1-8b", stacks=("trl_liger",)).model_dump_json())
    a = argparse.Namespace(settings=str(settings), stack="trl_liger", model=str(tmp_path), rows=str(tmp_path / "r"),
                           t_launch=0.0)
    assert cli.worker(a) == 0 and ran == ["trl_liger"]


def test_liger_on_lora_through_the_trainer_and_half_the_rows_after_an_oom(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_liger) -> None:
    import torch

    from benchmarks.stacks import trl_liger
    from jobs.training.backends.unsloth_lora import DEFAULT_TARGETS

    loads: list[int] = []
    calls: list[dict] = []

    def sft_window(model, tok, samples, win, *, batch, seed, peft_config=None, **config):
        calls.append({"batch": batch, "model": model, "peft": peft_config, **config})
        if batch == 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        win.step_done(1.0, 1000, 10)
        win.step_done(1.0, 1000, 10)
        return {"packing": True}

    monkeypatch.setattr(trl_liger, "load", lambda job: (loads.append(1) or object(), object()))
    monkeypatch.setattr(trl_liger, "sft_window", sft_window)
    monkeypatch.setattr(trl_liger, "peak_gb", lambda: {"peak_reserved_gb": 1.0})
    monkeypatch.setattr(trl_liger, "vocab_size", lambda _: 1000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=141e9))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    s = BenchSettings(arch="llama3.1-8b", stacks=("trl_liger",), profiles=("alpaca",), warmup=1, max_steps=1,
                      data_tokens=2000)
    rows = tmp_path / "rows.jsonl"
    trl_liger.run(s, Job("trl_liger", tmp_path, rows))
    got = [json.loads(x) for x in rows.read_text().splitlines()]
    assert [c["batch"] for c in calls] == [4, 2] and len(loads) == 2  # a fresh base for each window
    assert "OutOfMemoryError" in got[0]["error"] and got[1]["batch"] == "2 x 4096" and got[1]["real_tok_s"]
    for c in calls:
        assert c["use_liger_kernel"] is True and c["packing"] is True and c["max_length"] == s.trl_pack_length
        assert sorted(c["peft"].target_modules) == sorted(DEFAULT_TARGETS) and c["peft"].r == s.lora_r
