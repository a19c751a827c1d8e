"""The benchmark's FP8 side (issue 16): our path once per compute, MFU against each format's own peaks,
the numerics check's table."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import build_parser, main
from benchmarks.settings import BenchSettings


def test_compute_flag_is_parsed_and_checked(capsys):
    s = BenchSettings.from_args(build_parser().parse_args(["bench", "--arch", "x", "--compute", "bf16,fp8,fp8t"]))
    assert s.compute == ("bf16", "fp8", "fp8t") and s.ours_compute == "bf16" and s.fp8_learnable_steps == 30
    assert BenchSettings.model_validate_json(s.model_dump_json()) == s
    with pytest.raises(SystemExit):
        main(["bench", "--arch", "x", "--compute", "fp16"])
    assert "unknown compute(s) fp16" in capsys.readouterr().err


def test_ours_runs_once_per_compute_and_each_row_is_measured_against_its_own_peaks(tmp_path, monkeypatch, capsys):
    import benchmarks.cli as cli
    from benchmarks.model import ModelInfo

    seen = []

    def fake_spawn(stack, s, model, rows, timeout):
        seen.append((stack, s.ours_compute))
        tps = {"bf16": 15000.0, "fp8": 21000.0}[s.ours_compute]
        out = [{"stack": stack, "label": stack, "profile": "alpaca", "real_tok_s": tps, "compute": s.ours_compute,
                "variant": s.ours_compute}]
        if s.ours_compute == "fp8":
            out.append({"stack": "numerics", "compute": "fp8", "passed": True, "reasons": [], "layers": 224,
                        "converted": 224, "fp8_error": {"median": 0.037, "max": 0.041}, "nf4_error": {"median": 0.092},
                        "loss_max_rel_diff": 0.004, "loss_tolerance": 0.03, "activations": "random token ids"})
        with open(rows, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)
        return 0

    monkeypatch.setattr(cli, "spawn", fake_spawn)
    monkeypatch.setattr(cli, "resolve_model", lambda s: ModelInfo(tmp_path, 7_505_000_000))
    assert main(["bench", "--arch", "llama3.1-8b", "--stacks", "ours", "--compute", "bf16,fp8",
                 "--out", str(tmp_path / "o")]) == 0
    assert seen == [("ours", "bf16"), ("ours", "fp8")]
    doc = json.loads((tmp_path / "o" / "bench-llama3.1-8b.json").read_text())
    assert doc["exit_codes"] == {"ours": 0, "ours[fp8]": 0}
    bf16, fp8, numerics = doc["rows"]
    assert numerics["stack"] == "numerics" and "mfu_own" not in numerics
    flops = 4 * 7_505_000_000
    assert bf16["mfu_own"] == {"format": "bf16", "measured": pytest.approx(15000 * flops / 790e12),
                               "datasheet": pytest.approx(15000 * flops / 989.4e12)}
    assert fp8["mfu_own"] == {"format": "fp8", "measured": pytest.approx(21000 * flops / 1400e12),
                              "datasheet": pytest.approx(21000 * flops / 1978.9e12)}
    assert fp8["mfu"] == pytest.approx(21000 * flops / 790e12)  # the column every row shares
    assert fp8["x_ours_bf16"] == pytest.approx(1.4) and "x_ours_bf16" not in bf16
    text = capsys.readouterr().out
    assert "bf16 57.0 % / 45.5 %" in text and "fp8 45.0 % / 31.9 %" in text
    assert "| fp8 | passed | 224/224 | 0.0370 | 0.0410 | 0.0920 | 0.0040 | 0.03 |" in text


def test_the_quantisation_benchmark_times_each_layers_real_widths():
    """`bench fp8-quant` times what one decoder layer quantises per step; the widths come from the architecture
    (Qwen3-32B's queries are 64 x 128 = 8,192 wide, not its 5,120 hidden), and off CUDA it says so and stops."""
    from benchmarks.fp8_quant import arch_widths, layer_calls

    calls = {name: widths for name, widths, _ in layer_calls(*arch_widths("qwen3-32b"))}
    assert calls["fwd x (o)"] == (8192,) and calls["dgrad q,k,v"] == (8192, 1024, 1024)
    assert calls["dgrad up,gate"] == (25600, 25600) and calls["fwd x (q,k,v)"] == (5120,)
    with pytest.raises(SystemExit):
        main(["fp8-quant", "--arch", "llama3.1-8b"])  # the CLI's mode; no CUDA here
