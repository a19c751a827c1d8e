"""CPU checks of `python -m benchmarks workloads`: the command line, the plan of worker processes, the ratios
and MFU of the report (the GPU runs themselves: benchmarks/RESULTS.md)."""

from __future__ import annotations

import pytest

from benchmarks.cli import build_parser, main
from benchmarks.settings import BenchSettings
from benchmarks.worker_table import WORKERS
from benchmarks.workload_report import document, summarise
from benchmarks.workload_table import WORKLOADS
from benchmarks.workloads import _needs_ckpt, plan

B8 = 7_505_000_000


def settings(*argv: str) -> BenchSettings:
    import benchmarks.cli as cli

    captured: dict[str, BenchSettings] = {}
    real = cli.RUN["workloads"]
    cli.RUN["workloads"] = lambda s: captured.setdefault("s", s) and 0
    try:
        main(["workloads", *argv])
    finally:
        cli.RUN["workloads"] = real
    return captured["s"]


def test_quick_shortens_the_windows_and_explicit_flags_win():
    s = settings("--quick")
    assert (s.warmup, s.max_steps, s.seconds, s.data_tokens) == (2, 8, 8.0, 200_000)
    assert s.arch == "llama3.1-8b" and s.workloads == ("exxact", "alpaca", "fixstars", "full")
    assert (s.exxact_steps, s.alpaca_samples, s.alpaca_eval, s.alpaca_epochs, s.full_cap_gb) == (60, 2000, 200, 10, 48)
    s = settings("--quick", "--max-steps", "20", "--workloads", "full,fixstars", "--fixstars-archs",
                 "qwen3-8b,qwen3-32b", "--alpaca-whole", "--full-ckpt", "on")
    assert s.max_steps == 20 and s.warmup == 2 and s.workloads == ("full", "fixstars") and s.alpaca_whole
    assert s.fixstars_archs == ("qwen3-8b", "qwen3-32b") and s.full_ckpt == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["workloads", "--full-ckpt", "maybe"])
    with pytest.raises(ValueError, match="unknown workload"):
        BenchSettings(arch="x", workloads=("exxact", "nope"))


def test_the_plan_runs_each_recipe_beside_ours_and_builds_each_model_once():
    s = BenchSettings(arch="llama3.1-8b", fixstars_archs=("qwen3-8b", "qwen3-32b"))
    spawns = plan(s)
    assert [(p.stack, p.arch, p.build_4bit) for p in spawns] == [
        ("w_hf", "llama3.1-8b", False), ("w_ours_lora", "llama3.1-8b", False),
        ("w_fixstars", "qwen3-8b", True), ("w_ours_qlora", "qwen3-8b", True),
        ("w_ours_full", "llama3.1-8b", False), ("w_full", "llama3.1-8b", False),
        ("w_fixstars", "qwen3-32b", True), ("w_ours_qlora", "qwen3-32b", True)]
    assert spawns[-1].update == {"max_vram_gb": 72.0} and spawns[3].update == {"max_vram_gb": 40.0}
    assert all(p.stack in WORKERS for p in spawns)
    assert [p.stack for p in plan(BenchSettings(arch="a", workloads=("alpaca",)))] == ["w_hf", "w_ours_lora"]


def row(workload, side, profile="p", **kw):
    return {"workload": workload, "side": side, "arch": "llama3.1-8b", "profile": profile, "label": side,
            "flops_per_token_param": 6 if workload == "full" else 4, **kw}


def test_ratios_on_each_workloads_headline_and_mfu_against_both_peaks():
    rows = summarise([
        row("exxact", "publication", real_tok_s=5000.0), row("exxact", "ours", real_tok_s=20000.0),
        row("alpaca", "publication", job_seconds=600.0, real_tok_s=3000.0),
        row("alpaca", "ours", job_seconds=150.0, real_tok_s=18000.0, job_basis="extrapolated: ..."),
        row("fixstars", "publication", "alpaca", samples_per_hour=50_000.0, real_tok_s=1.0),
        row("fixstars", "ours", "alpaca", samples_per_hour=400_000.0, real_tok_s=2.0),
        row("fixstars", "ours", "wiki", samples_per_hour=60_000.0),  # no recipe row for wiki: no ratio
        row("full", "publication", error="OutOfMemoryError: CUDA out of memory", fits=False),
        row("full", "ours", real_tok_s=8000.0, fits=True),
    ], matmul={"llama3.1-8b": B8})
    by = {(r["workload"], r["side"], r["profile"]): r for r in rows}
    assert by[("exxact", "ours", "p")]["x_publication"] == pytest.approx(4.0)
    assert by[("alpaca", "ours", "p")]["x_publication"] == pytest.approx(4.0)  # seconds: theirs / ours
    assert by[("fixstars", "ours", "alpaca")]["x_publication"] == pytest.approx(8.0)
    assert "x_publication" not in by[("fixstars", "ours", "wiki")] and "x_publication" not in by[("full", "ours", "p")]
    assert by[("exxact", "ours", "p")]["mfu_790"] == pytest.approx(20000 * 4 * B8 / 790e12)
    assert by[("full", "ours", "p")]["mfu_989"] == pytest.approx(8000 * 6 * B8 / 989e12)  # full: 6 FLOPs
    text = document(rows, list(WORKLOADS.values()), gpu="H200", when="now")
    for w in WORKLOADS.values():
        assert f"## {w.title}" in text and w.published in text
    assert text.count("where the recipes differ") == 4 and "error: OutOfMemoryError" in text
    assert "ours job time: extrapolated" in text and "| 4.00 |" in text


def test_ours_full_is_rerun_with_checkpointing_only_when_nothing_fits_without():
    assert _needs_ckpt([row("full", "ours", error="not even 2048 tokens per step fit under 48 GB")])
    assert not _needs_ckpt([row("full", "ours", real_tok_s=1.0)])
    assert not _needs_ckpt([row("full", "publication", error="not even")])


def test_ours_runs_once_per_compute_beside_one_recipe_run_and_each_gets_its_ratio():
    """`--compute bf16,fp8` (issue 16 on the published workloads): ours twice, the recipe once."""
    s = settings("--workloads", "exxact,fixstars", "--fixstars-archs", "qwen3-32b", "--compute", "bf16,fp8")
    assert s.compute == ("bf16", "fp8")
    assert [(p.stack, p.update) for p in plan(s)] == [
        ("w_hf", {}), ("w_ours_lora", {}), ("w_ours_lora", {"ours_compute": "fp8"}),
        ("w_fixstars", {}), ("w_ours_qlora", {"max_vram_gb": 72.0}),
        ("w_ours_qlora", {"max_vram_gb": 72.0, "ours_compute": "fp8"})]
    rows = summarise([row("exxact", "publication", real_tok_s=1000.0),
                      row("exxact", "ours", real_tok_s=2000.0, compute="bf16"),
                      row("exxact", "ours", real_tok_s=2500.0, compute="fp8")], matmul={"llama3.1-8b": B8})
    assert [r.get("x_publication") for r in rows] == [None, 2.0, 2.5]
