"""CPU checks of the bench's pure parts and the architecture registry (the GPU runs: results/)."""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from jobs.bench.cli import PROFILES, build_parser, make_samples, sample_lengths, summarise, table
from jobs.training.architectures import ARCHITECTURES, MARKER, build_random_model, make_config, matmul_params


@pytest.mark.parametrize("profile", list(PROFILES))
def test_length_profiles_have_their_mean_after_the_cap(profile):
    lengths = sample_lengths(profile, 5000)
    assert statistics.mean(lengths) == pytest.approx(PROFILES[profile], rel=0.01)
    assert min(lengths) >= 8 and max(lengths) <= 2048
    assert sample_lengths(profile, 100) == sample_lengths(profile, 100)  # deterministic


def test_make_samples_reaches_token_count_with_valid_ids():
    samples = make_samples("alpaca", 20000, vocab=1000)
    assert sum(s.n_tokens for s in samples) >= 20000
    assert all(16 <= t < 1000 - 16 for s in samples[:50] for t in s.input_ids)


def test_matmul_params_of_known_architectures():
    assert matmul_params(make_config("llama3.1-8b")) == pytest.approx(7.50e9, rel=0.005)  # ANCHORS: 7.5 B
    assert matmul_params(make_config("qwen3-32b")) == pytest.approx(31.98e9, rel=0.005)
    moe = make_config("gpt-oss-small")
    # active experts only (top-4 of 32), not all of them
    assert matmul_params(moe) < 2 * (4 * 3 * 2880 * 2880) + 2 * 30e6 + 201088 * 2880
    assert set(ARCHITECTURES) >= {"llama3.1-8b", "qwen3-8b", "qwen3-32b", "gpt-oss-small"}


def test_summary_ratios_and_table():
    rows = [
        {"stack": "baseline", "label": "b", "profile": "alpaca", "real_tok_s": 1500.0},
        {"stack": "trl", "label": "t", "profile": "alpaca", "real_tok_s": 7500.0},
        {"stack": "ours", "label": "o", "profile": "alpaca", "real_tok_s": 15000.0},
        {"stack": "trl", "label": "t2", "profile": "wiki", "error": "OutOfMemoryError"},
    ]
    out = summarise(rows, matmul=7.5e9, peak_flops=790e12)
    ours = out[2]
    assert ours["x_baseline"] == pytest.approx(10.0)
    assert ours["x_unsloth_best"] == pytest.approx(2.0)
    assert ours["mfu"] == pytest.approx(15000 * 4 * 7.5e9 / 790e12)
    text = table(out)
    assert "15,000" in text and "error: OutOfMemoryError" in text


def test_parser_defaults_match_the_published_protocol():
    a = build_parser().parse_args(["bench", "--arch", "llama3.1-8b"])
    assert (a.warmup, a.max_steps, a.seconds, a.max_vram_gb) == (3, 30, 30.0, 40.0)
    assert a.profiles == ["alpaca", "wiki"] and a.stacks == ["ours", "baseline", "unsloth", "trl"]


def test_build_tiny_random_model_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_random_model("tiny-llama", tmp_path / "tiny", device="cpu")
    assert json.loads((d / MARKER).read_text())["arch"] == "tiny-llama"
    m = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert m.config.vocab_size == 512 and tok.pad_token_id is not None
    assert build_random_model("tiny-llama", d, device="cpu") == d  # found, not rebuilt


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_build_4bit_directly(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_random_model("tiny-llama", tmp_path / "tiny4", device="cpu", load_in_4bit=True)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["load_in_4bit"]
    m = AutoModelForCausalLM.from_pretrained(str(d), device_map={"": "cpu"})
    assert type(m.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
