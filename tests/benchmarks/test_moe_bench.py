"""CPU checks of the benchmark's moe workload (issue 15): flags, the in-memory model in the parent, the
GPT-OSS-120B architecture's counts, the profile summary's arithmetic. The GPU run: RESULTS.md: 2026-11-23, MoE 120B."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import build_parser, main
from benchmarks.profiling import busy_time
from benchmarks.settings import BenchSettings
from jobs.training.models.architectures import make_config, matmul_params
from jobs.training.moe.lora import expected_lora_parameters
from tests.benchmarks.test_bench import _parent


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--arch", "gpt-oss-120b", "--stacks", "moe"], "builds its model in GPU memory: add --in-memory"),
        (["bench", "--arch", "gpt-oss-120b", "--in-memory"], "only the moe stack starts from a model built in memory"),
        (["bench", "--model", "/m", "--in-memory", "--stacks", "moe"], "--in-memory needs --arch"),
    ],
)
def test_in_memory_and_the_moe_stack_go_together(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_moe_flags_cross_to_the_worker():
    a = build_parser().parse_args(["bench", "--arch", "gpt-oss-120b", "--in-memory", "--stacks", "moe",
                                   "--vram-from-free", "--trl-recipe", "--profile-steps", "2", "--lora-r", "8"])
    s = BenchSettings.from_args(a)
    assert s.in_memory and s.vram_from_free and s.trl_recipe and s.profile_steps == 2 and s.lora_r == 8
    assert BenchSettings.model_validate_json(s.model_dump_json()) == s


@pytest.mark.parametrize("argv", [["bench", "--stacks", "moe", "--in-memory"], ["moe"]])
def test_the_parent_builds_nothing_for_an_in_memory_model(tmp_path, argv):
    """GPT-OSS-120B's 4-bit weights do not fit the disk: the parent neither builds nor imports torch; the
    worker builds the model in GPU memory. MFU's denominator: the 5.1 B active matmul parameters."""
    out = _parent(*argv, "--arch", "gpt-oss-120b", "--models-dir", str(tmp_path / "models"),
                  "--out", str(tmp_path / "o"))
    assert out == {"rc": 0, "imported": []}
    assert not (tmp_path / "models").exists()
    doc = json.loads((tmp_path / "o" / "bench-gpt-oss-120b.json").read_text())
    assert doc["model"] == "in-memory:gpt-oss-120b" and doc["settings"]["in_memory"]
    assert doc["matmul_params"] == matmul_params(make_config("gpt-oss-120b")) == pytest.approx(5.131e9, rel=1e-3)
    assert doc["exit_codes"] == {"moe": 0}


def test_gpt_oss_120b_is_the_published_model():
    """116.8 B parameters (what Unsloth printed), and r=8 on attention alone is the published run's
    5,971,968 trainable parameters: the experts add 530.8 M."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = make_config("gpt-oss-120b")
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert total == pytest.approx(116.83e9, rel=1e-3)
    lora = expected_lora_parameters(cfg, 8)
    assert lora["attention"] == 5_971_968 and lora["experts"] == 530_841_600


def test_gpu_idle_share_arithmetic():
    assert busy_time([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == 4
    assert busy_time([]) == 0
