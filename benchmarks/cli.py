"""`python -m benchmarks`: the command line, and the parent that runs one worker process per stack.

The parent holds no GPU memory: it never imports torch (the model is built or read in a child,
benchmarks.model), spawns `python -m benchmarks worker --stack NAME ...` for each stack with the
settings as JSON on its stdin, reads back the rows the workers append, and writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from benchmarks.measure import smi_log
from benchmarks.model import in_memory_model, resolve_model
from benchmarks.report import gpu_info, numerics_table, read_rows, summarise, table, write_result
from benchmarks.settings import PEAK_BF16, STACKS, BenchSettings
from benchmarks.spawn import spawn
from jobs.training.models.synthetic import CAP, PROFILES

MODES = ("bench", "faststart", "budget", "moe", "workloads", "scaling")


def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="QLoRA throughput measured side by side on this GPU: HF transformers + PEFT, Unsloth, "
        "Unsloth + TRL and nightshift, each stack in its own process (see benchmarks/__init__.py).",
        epilog="modes: bench (stacks side by side), faststart (time to first step, night 1 / night 2), "
        "budget (plan from a calibration, then train: predicted vs actual), moe (LoRA reaches the experts?), "
        "workloads (the published runs, each recipe beside ours: benchmarks/workloads.py), "
        "scaling (ours and the Exxact recipe on 1 and --gpus N GPUs: the scaling efficiency); "
        "and `python -m benchmarks acceptance --help`: the whole product on one card (daemon, server, nights)",
    )
    hidden = argparse.SUPPRESS
    p.add_argument("mode", choices=[*MODES, "worker"], metavar="{" + ",".join(MODES) + "}")
    p.add_argument("--model", help="local HF model directory")
    p.add_argument("--arch", help="architecture name, built random-initialised (jobs.training.models.architectures)")
    p.add_argument("--models-dir", default=os.environ.get("NIGHTSHIFT_BENCH_MODELS", "/tmp/nightshift-models"))
    p.add_argument("--build-4bit", action="store_true", help="build the random model directly as NF4 (32B)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stacks", type=_csv, default=list(STACKS), help=f"comma-separated (default: {','.join(STACKS)})")
    p.add_argument("--profiles", type=_csv, default=list(PROFILES),
                   help=f"comma-separated length profiles (default: {','.join(PROFILES)})")
    p.add_argument("--max-vram-gb", type=float, default=40.0)
    p.add_argument("--headroom-gb", type=float, default=3.0, help="CUDA context + allocator slack")
    p.add_argument("--max-budget", type=int, default=32768, help="token budget per step, at most")
    p.add_argument("--budget", type=int, default=0, help="force the token budget (skip the choice)")
    p.add_argument("--probe-tokens", type=int, default=2048)
    p.add_argument("--ours-ckpt", action="store_true", help="our path with Unsloth checkpointing (large models)")
    p.add_argument("--compute", type=_csv, default=["bf16"],
                   help="ours: comma-separated bf16, fp8 (frozen base on FP8, an e4m3 copy), fp8-nf4 (kept in "
                        "NF4), fp8t (the e4m3 copy + a kept transposed copy); "
                        "each in its own process (default: bf16)")
    p.add_argument("--fp8-learnable-steps", type=int, default=30,
                   help="ours fp8: steps per loss curve of the numerics check (0: per-layer errors only)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--data-tokens", type=int, default=400_000, help="random tokens generated per profile")
    p.add_argument("--trl-pack-length", type=int, default=4096)
    p.add_argument("--trl-configs", type=_csv, default=["padding_free", "packing"],
                   help="comma-separated (default: padding_free,packing)")
    p.add_argument("--peak-flops", type=float, default=PEAK_BF16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-share", type=float, default=0.0,
                   help="ours: the share of each sample's first tokens not trained on, as a night's prompts "
                        "(calibrate trains on every token; default: 0)")
    p.add_argument("--token-file", help="ours: cut the samples from this file's records (JSONL, tokenised by "
                                        "the model's tokenizer) instead of random ids")
    p.add_argument("--state-dir", help="nightshift state dir: NF4 base cache and compile caches")
    p.add_argument("--deadline", type=float, default=0, help="seconds for all stacks; later ones are skipped")
    p.add_argument("--smi-log", help="also log nvidia-smi readings (CSV) to this file")
    p.add_argument("--smi-fields", default="timestamp,power.draw,memory.used,utilization.gpu")
    p.add_argument("--gpu-events", help="ours: write the NVML sampler's events (JSON lines) here")
    p.add_argument("--drop-caches", action="store_true", help="faststart: drop the page cache before each night")
    p.add_argument("--torch-profile", help="ours: profile 3 steps per profile into <this>.<profile>.txt")
    p.add_argument("--budget-seconds", type=lambda s: [float(x) for x in _csv(s)], default=[60.0, 180.0],
                   help="budget: seconds of alpaca, then of wiki data (default: 60,180)")
    p.add_argument("--in-memory", action="store_true",
                   help="moe: build --arch random-initialised in GPU memory, NF4, no directory (GPT-OSS-120B)")
    p.add_argument("--vram-from-free", action="store_true",
                   help="moe: cap the step's memory at what the GPU has free at start (else --max-vram-gb)")
    p.add_argument("--profile-steps", type=int, default=3, help="moe: steps profiled per profile (--torch-profile)")
    p.add_argument("--trl-recipe", action="store_true",
                   help="moe: also the published recipe: TRL SFTTrainer, padded batch 32 / 16, grad. ckpt")
    w = p.add_argument_group("workloads")
    w.add_argument("--workloads", type=_csv, help="comma-separated (default: exxact,alpaca,fixstars,full)")
    w.add_argument("--quick", action="store_true",
                   help="short timed windows (2 warm-up + 8 steps or 8 s, 200k tokens per profile): every "
                   "workload's key rows in about 8 minutes on an H200")
    w.add_argument("--llama-arch", help="the 8B of exxact, alpaca and full (default llama3.1-8b, built in bf16)")
    w.add_argument("--fixstars-archs", type=_csv, help="default qwen3-8b; add qwen3-32b for the 32B rows")
    w.add_argument("--exxact-steps", type=int)
    w.add_argument("--alpaca-samples", type=int)
    w.add_argument("--alpaca-eval", type=int)
    w.add_argument("--alpaca-epochs", type=int)
    w.add_argument("--alpaca-whole", action="store_true", default=None,
                   help="run the whole Alpaca job on both sides (else a timed window, extrapolated)")
    w.add_argument("--full-cap-gb", type=float, help="full fine-tuning: the hard memory cap (default 48)")
    w.add_argument("--full-ckpt", choices=["auto", "on", "off"], help="ours, full: checkpointing (default auto)")
    p.add_argument("--gpus", type=int, default=2, help="scaling: N, compared with 1 (default: 2)")
    p.add_argument("--scaling-workloads", type=_csv, default=["ours", "exxact"],
                   help="scaling: comma-separated (default: ours,exxact)")
    # the worker's own (the parent passes them; settings come as JSON on stdin)
    p.add_argument("--stack", help=hidden)
    p.add_argument("--rows", help=hidden)
    p.add_argument("--t-launch", type=float, default=0.0, help=hidden)
    p.add_argument("--settings", help=hidden)  # a file: torchrun's workers share one stdin
    return p


def bench(s: BenchSettings) -> int:
    """Every stack in turn, each in its own process; then ratios, the table and the JSON."""
    model = in_memory_model(s) if s.in_memory else resolve_model(s)
    s.out.mkdir(parents=True, exist_ok=True)
    name = s.arch or model.path.name
    rows_path = s.out / f"bench-{name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    codes: dict[str, int | str] = {}
    t0 = time.time()
    with smi_log(s.smi_log, s.smi_fields):
        for stack in s.stacks:
            for c in (s.compute if stack == "ours" else ("bf16",)):  # ours: one worker per compute (issue 16)
                run_name = stack if c == "bf16" else f"{stack}[{c}]"
                left = s.deadline - (time.time() - t0) if s.deadline else 3600
                if left < 30:
                    codes[run_name] = "skipped: no time left"
                    continue
                codes[run_name] = spawn(stack, s.model_copy(update={"ours_compute": c}), model.path, rows_path, left)
    rows = summarise(read_rows(rows_path), matmul=model.matmul_params, peak_flops=s.peak_flops)
    write_result(
        s.out / f"bench-{name}.json",
        mode="bench",
        model=str(model.path),
        arch=s.arch,
        matmul_params=model.matmul_params,
        peak_flops=s.peak_flops,
        max_vram_gb=s.max_vram_gb,
        lora_r=s.lora_r,
        settings={**s.model_dump(mode="json"), "cap": CAP},
        exit_codes=codes,
        gpu=gpu_info(),
        rows=rows,
    )
    print(table(rows))
    numerics = numerics_table(rows)
    if numerics:
        print(numerics)
    return 0 if rows else 1


def faststart(s: BenchSettings) -> int:
    """Two 'nights' in fresh processes sharing one state dir: the second reuses the NF4 base and caches."""
    model = resolve_model(s)
    s.out.mkdir(parents=True, exist_ok=True)
    rows_path = s.out / f"faststart-{s.arch or model.path.name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    if s.state_dir is None:
        s = s.model_copy(update={"state_dir": Path(tempfile.mkdtemp(prefix="nightshift-state-"))})
    for _night in (1, 2):
        if s.drop_caches:  # a later night starts with a cold page cache: measure that, not a warm one
            os.sync()
            with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        spawn("first_step", s, model.path, rows_path, 900)
    rows = read_rows(rows_path)
    for i, r in enumerate(rows, 1):
        print(
            f"night {i}: first step {r['first_step_s']} s after launch "
            f"(loaded at {r['launch_to_loaded_s']} s, cache hit {r['load'].get('base_cache_hit')})"
        )
    return 0 if rows else 1


def moe(s: BenchSettings) -> int:
    """The moe stack alone, on --arch built in GPU memory (what `bench --stacks moe --in-memory` runs)."""
    return bench(s.model_copy(update={"stacks": ("moe",), "in_memory": True}))


def budget(s: BenchSettings) -> int:
    model = resolve_model(s)
    s.out.mkdir(parents=True, exist_ok=True)
    rows = s.out / f"budget-{s.arch or model.path.name}.rows.jsonl"
    return spawn("budget", s, model.path, rows, s.deadline or None)


def workloads(s: BenchSettings) -> int:
    from benchmarks.workloads import run_workloads

    return run_workloads(s)


def scaling(s: BenchSettings) -> int:
    from benchmarks.scaling import scaling as run_scaling

    return run_scaling(s)


RUN: dict[str, Callable[[BenchSettings], int]] = {"bench": bench, "faststart": faststart, "budget": budget, "moe": moe,
                                                  "workloads": workloads, "scaling": scaling}
QUICK = {"warmup": 2, "max_steps": 8, "seconds": 8.0, "data_tokens": 200_000}


def worker(a: argparse.Namespace) -> int:
    """In the worker process: one stack, its rows appended to --rows."""
    from benchmarks.stacks import worker as stack_worker
    from benchmarks.stacks.common import Job
    from jobs.training.backends.unsloth import setup_caches

    # a file under torchrun; stdin from the parent; by hand, from a terminal: the flags instead
    text = Path(a.settings).read_text() if a.settings else ("" if sys.stdin.isatty() else sys.stdin.read())
    s = BenchSettings.model_validate_json(text) if text.strip() else BenchSettings.from_args(a)
    setup_caches(s.state_dir)  # before anything imports torch's compile machinery
    from jobs.training.ranks.collectives import bind_device

    bind_device()  # a torchrun worker (scaling): its own card before Unsloth's import looks at CUDA
    # moe: our own MoE path; the plain HF stacks as shipped (trl_liger: TRL + Liger, no Unsloth);
    # scaling_ours: Unsloth where it is installed
    if a.stack not in ("baseline", "moe", "w_hf", "exxact", "trl_liger") and (
            a.stack != "scaling_ours" or importlib.util.find_spec("unsloth")):
        from jobs.training.backends.unsloth_import import import_unsloth

        import_unsloth(trl_trainers=True)  # before the stack imports transformers; whole: TRL's recipes
    stack_worker(a.stack)(s, Job(a.stack, Path(a.model), Path(a.rows), a.t_launch))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["acceptance"]:  # the end-to-end acceptance run has its own options
        from benchmarks.acceptance.run import main as acceptance

        return acceptance(args[1:])
    if args[:1] == ["parity"]:  # bf16 / NF4 / FP8 nights of one task, scored by exact match (its own options)
        from benchmarks.parity import main as parity

        return parity(args[1:])
    if args[:1] == ["fp8-quant"]:  # a kernel micro-benchmark, no worker processes
        from benchmarks.fp8_quant import main as fp8_quant

        return fp8_quant(args[1:])
    parser = build_parser()
    a = parser.parse_args(args)
    if a.mode == "worker":
        if not (a.stack and a.model and a.rows):
            parser.error("worker needs --stack, --model and --rows")
        return worker(a)
    if a.mode == "workloads":
        a.arch = a.arch or a.llama_arch or "llama3.1-8b"  # each workload names its models; this one is the 8B
        if a.quick:
            for k, v in QUICK.items():
                if getattr(a, k) == parser.get_default(k):
                    setattr(a, k, v)
    try:
        s = BenchSettings.from_args(a)
    except ValidationError as e:
        parser.error("; ".join(f"{'.'.join(map(str, x['loc'])) or 'settings'}: {x['msg']}" for x in e.errors()))
    return RUN[a.mode](s)
