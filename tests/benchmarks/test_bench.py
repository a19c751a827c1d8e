"""CPU checks of the bench's pure parts and the architecture registry (the GPU runs: benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.cli import build_parser, main
from benchmarks.report import summarise, table
from benchmarks.settings import BenchSettings
from jobs.training.models.architectures import ARCHITECTURES, MARKER, build_random_model, make_config, matmul_params
from jobs.training.models.synthetic import PROFILES, make_samples, sample_lengths
from tests.conftest import hang_bound

REPO = Path(__file__).resolve().parents[2]


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
    assert ours["mfu_989"] == pytest.approx(15000 * 4 * 7.5e9 / 989.4e12)  # both peaks in the JSON (issue 44)
    text = table(out)
    assert "15,000" in text and "error: OutOfMemoryError" in text


def test_parser_defaults_match_the_published_protocol():
    a = build_parser().parse_args(["bench", "--arch", "llama3.1-8b"])
    assert (a.warmup, a.max_steps, a.seconds, a.max_vram_gb) == (3, 30, 30.0, 40.0)
    assert a.profiles == ["alpaca", "wiki"] and a.stacks == ["ours", "baseline", "unsloth", "trl"]
    s = BenchSettings.from_args(a)
    assert (s.warmup, s.max_steps, s.seconds, s.max_vram_gb) == (3, 30, 30.0, 40.0)
    assert s.profiles == ("alpaca", "wiki") and s.stacks == ("ours", "baseline", "unsloth", "trl")


def test_settings_cross_to_the_worker_unchanged():
    a = build_parser().parse_args(["bench", "--arch", "qwen3-32b", "--build-4bit", "--ours-ckpt", "--profiles",
                                   "wiki", "--state-dir", "/s", "--budget-seconds", "30,90"])
    s = BenchSettings.from_args(a)
    assert BenchSettings.model_validate_json(s.model_dump_json()) == s
    assert s.build_4bit and s.ours_ckpt and s.profiles == ("wiki",) and s.budget_seconds == (30.0, 90.0)
    with pytest.raises(Exception, match="frozen"):
        s.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench"], "--model DIR or --arch NAME"),
        (["bench", "--arch", "x", "--profiles", "alpaca,code"], "unknown profile"),
        (["bench", "--arch", "x", "--stacks", "ours,vllm"], "unknown stack"),
        (["worker", "--stack", "ours"], "worker needs"),
    ],
)
def test_bad_flags_are_reported_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_help_shows_what_users_pass_not_the_worker_flags():
    text = build_parser().format_help()
    assert "--arch" in text and "faststart" in text
    for internal in ("worker", "--stack ", "--rows", "--t-launch"):
        assert internal not in text
    a = build_parser().parse_args(["worker", "--stack", "ours", "--model", "m", "--rows", "r", "--t-launch", "5"])
    assert (a.mode, a.stack, a.rows, a.t_launch) == ("worker", "ours", "r", 5.0)  # hidden, still there


PARENT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import benchmarks.cli as cli

    def fake_spawn(stack, s, model, rows, timeout):  # a worker's row, without the worker
        with open(rows, "a") as f:
            f.write(json.dumps({"stack": stack, "label": stack, "profile": "alpaca", "real_tok_s": 1000.0}) + "\\n")
        return 0

    cli.spawn = fake_spawn
    rc = cli.main(sys.argv[1:])
    print(json.dumps({"rc": rc, "imported": [m for m in ("torch", "transformers") if m in sys.modules]}))
    """
)


def _parent(*argv: str) -> dict:
    """The bench's parent in a process of its own (its stacks faked): its exit and the heavy modules it imported."""
    p = subprocess.run([sys.executable, "-c", PARENT, *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=hang_bound(300))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_parent_never_imports_torch_building_or_finding_the_model(tmp_path):
    """The card is free while workers run: the random model is built in a child, found from its marker."""
    args = ["bench", "--arch", "tiny-llama", "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "o"),
            "--stacks", "ours,baseline"]
    assert _parent(*args) == {"rc": 0, "imported": []}  # built (in a child)
    assert (tmp_path / "models" / "tiny-llama" / MARKER).exists()
    assert _parent(*args) == {"rc": 0, "imported": []}  # found
    doc = json.loads((tmp_path / "o" / "bench-tiny-llama.json").read_text())
    assert doc["matmul_params"] == matmul_params(make_config("tiny-llama"))
    assert [r["x_baseline"] for r in doc["rows"]] == [1.0, 1.0] and doc["exit_codes"] == {"ours": 0, "baseline": 0}


def test_parent_reads_a_model_dir_without_marker_in_a_child(tmp_path):
    d = tmp_path / "m"
    make_config("llama3.1-8b").save_pretrained(d)  # config.json only: described through transformers
    out = _parent("bench", "--model", str(d), "--out", str(tmp_path / "o"), "--stacks", "ours")
    assert out == {"rc": 0, "imported": []}
    doc = json.loads((tmp_path / "o" / "bench-m.json").read_text())
    assert doc["matmul_params"] == pytest.approx(7.50e9, rel=0.005)


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
