"""`[train] method` in the config, the throughput key, the disk a night needs and the lineage rules (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from jobs.contract import Method
from jobs.learning import plan as budget
from jobs.night.config import NightConfig
from jobs.night.lineage import MethodChangeError, check_checkpoint, check_continuation, method_of
from jobs.night.model import throughput_key
from jobs.night.space import night_disk_need_gb
from jobs.training.config import TrainConfig


def night(tmp_path: Path, **train) -> NightConfig:
    return NightConfig.model_validate({"state_dir": tmp_path, "model": {"path": tmp_path / "m"}, "train": train})


def test_method_config_defaults_and_contradictions():
    assert TrainConfig().method is Method.qlora and TrainConfig().quantized_base
    assert not TrainConfig(method="lora").quantized_base
    assert TrainConfig(method="full").learning_rate == 2e-5 and TrainConfig(method="lora").learning_rate == 2e-4
    assert TrainConfig(method="full", learning_rate=1e-4).learning_rate == 1e-4
    full = TrainConfig(method="full")
    assert TrainConfig.model_validate_json(full.model_dump_json()) == full  # crosses the child's pipe unchanged
    assert TrainConfig(load_in_4bit=True).method is Method.qlora  # configs from before `method` still load
    with pytest.raises(ValidationError, match=r'\[train\] load_in_4bit = true contradicts method = "lora"'):
        TrainConfig(method="lora", load_in_4bit=True)
    with pytest.raises(ValidationError, match=r'load_in_4bit = false: say method = "lora"'):
        TrainConfig(load_in_4bit=False)
    with pytest.raises(ValidationError, match="method"):
        TrainConfig(method="dora")


def test_the_method_is_part_of_the_throughput_key_and_qlora_keys_stay(tmp_path):
    keys = {m: throughput_key(night(tmp_path, method=m), "fp", "unsloth", "H200") for m in ("qlora", "lora", "full")}
    assert len(set(keys.values())) == 3
    t = TrainConfig()  # the key qlora nights were filed under before methods existed: their history still counts
    before = budget.throughput_key({
        "model": "fp", "backend": "unsloth", "device": "H200", "rank": t.lora_rank, "targets": t.target_modules,
        "batch_size": t.batch_size, "max_tokens": t.max_tokens_per_batch, "max_seq": t.max_seq_length,
        "grad_ckpt": t.gradient_checkpointing, "4bit": True, "batching": t.batching,
        "tokens_per_step": t.tokens_per_step, "max_vram_gb": None})
    assert keys["qlora"] == before
    assert throughput_key(night(tmp_path, method="full", optimizer="adamw_8bit"), "fp", "unsloth", "H200") \
        != keys["full"]


def test_full_fine_tuning_needs_disk_for_two_checkpoints_of_the_whole_model(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 3_000_000)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 1_000_000)
    assert night_disk_need_gb(night(tmp_path)) == night_disk_need_gb(night(tmp_path, method="lora")) == 0
    assert night_disk_need_gb(night(tmp_path, method="full")) == pytest.approx(2 * 0.004 * 3)  # AdamW: 2 moments
    assert night_disk_need_gb(night(tmp_path, method="full", optimizer="adamw_8bit")) == pytest.approx(2 * 0.004 * 2)


def test_which_method_a_version_was_trained_with():
    assert method_of({"method": "full"}) is Method.full
    assert method_of({"config": {"train": {"method": "lora"}}}) is Method.lora
    assert method_of({"version": 1, "config": {"train": {"lora_rank": 8}}}) is Method.qlora  # before methods


@pytest.mark.parametrize(("was", "now", "allowed"), [
    ("qlora", "qlora", False), ("lora", "lora", False), ("full", "full", False),
    ("qlora", "lora", True), ("lora", "qlora", True)])
def test_continuing_is_allowed_for_the_same_method_or_when_told(was, now, allowed):
    check_continuation(TrainConfig(method=now, allow_method_change=allowed), "tiny-v0003", Method(was))


@pytest.mark.parametrize(("was", "now"), [("qlora", "full"), ("full", "lora"), ("full", "qlora"), ("lora", "qlora")])
def test_continuing_across_a_method_change_is_refused_clearly(was, now):
    with pytest.raises(MethodChangeError) as e:
        check_continuation(TrainConfig(method=now, allow_method_change="full" in (was, now)),
                           "tiny-v0003", Method(was))
    msg = str(e.value)
    assert msg.startswith(f'[train] method = "{now}", but the version in service tiny-v0003 was trained as "{was}"')
    assert f'Set method = "{was}" again' in msg
    assert ("allow_method_change" in msg) == ("full" not in (was, now))  # no flag turns an adapter into a model


def test_a_checkpoint_resumes_only_under_the_method_that_wrote_it(tmp_path):
    check_checkpoint(tmp_path, Method.full, resuming=False)
    assert json.loads((tmp_path / "method.json").read_text()) == {"method": "full"}
    check_checkpoint(tmp_path, Method.full, resuming=True)
    with pytest.raises(MethodChangeError, match='checkpointed as "full"'):
        check_checkpoint(tmp_path, Method.lora, resuming=True)


def test_qlora_without_cuda_is_lora_and_continues_an_older_cpu_version_labelled_qlora():
    """A CPU night quantises nothing: its label is lora (issue 42). Versions a CPU trained before were labelled
    qlora; without CUDA both are the same base precision, so the lineage goes on."""
    assert Method.qlora.on(False) is Method.lora and Method.qlora.on(True) is Method.qlora
    assert Method.full.on(False) is Method.full
    check_continuation(TrainConfig(method="qlora"), "tiny-v0003", Method.qlora, cuda=False)
    check_continuation(TrainConfig(method="qlora"), "tiny-v0003", Method.lora, cuda=False)
    with pytest.raises(MethodChangeError):
        check_continuation(TrainConfig(method="qlora"), "tiny-v0003", Method.lora, cuda=True)
