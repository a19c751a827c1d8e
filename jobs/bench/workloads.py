"""`nightshift bench workloads`: the four published fine-tuning runs nightshift is built from, each run the
publication's way and ours on this GPU in one run, side by side.

    python -m jobs.bench workloads --quick --out DIR --state-dir S      (every workload's key rows, ~8 min, H200)

Models are random-initialised from the real configs (jobs/training/architectures.py) and built once per
run: Llama-3.1-8B in bf16 (exxact, alpaca, full; Llama-3-8B has the same shapes), Qwen3-8B / Qwen3-32B
directly as NF4 (fixstars). Data are random tokens with the workloads' lengths. Each side runs in its own
worker process (jobs/bench/stacks/w_*.py); the report (workload_report.py) puts ours beside the recipe:
tok/s, samples/h or the whole job's seconds, peak memory, J per 1k tokens, MFU against 790 and 989 TFLOP/s,
and the ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jobs.bench.settings import BenchSettings


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    recipe: str  # the publication's, as it published it
    published: str  # its figure
    ours: str  # how ours runs the same work
    differ: tuple[str, ...]  # where the two recipes differ (and what we had to assume)
    headline: str  # the figure the ratio is taken on: real_tok_s | samples_per_hour | job_seconds


COMMON = "random-initialised weights and random tokens (speed depends on shapes, not values)"
WORKLOADS: dict[str, Workload] = {
    "exxact": Workload(
        "exxact", "Exxact: Llama-3.1-8B, LoRA bf16",
        "HF transformers Trainer + PEFT, LoRA r=16 on q_proj and v_proj, bf16 base, 512-token sequences, batch 2, "
        "60 steps", "4,962 tok/s on one RTX PRO 6000 Server Edition",
        "method lora: the bf16 base through Unsloth, the same adapter and sequences, packed into rows of a token "
        "budget probed under --max-vram-gb, varlen attention, no checkpointing",
        ("ours packs the 512-token sequences into budgeted rows; the recipe steps 2 x 512 tokens",
         "ours runs Unsloth's LoRA kernels; the recipe runs PEFT on transformers' SDPA attention",
         "lora_alpha 32, dropout 0.05, learning rate 2e-4 assumed (unpublished)", COMMON),
        "real_tok_s"),
    "alpaca": Workload(
        "alpaca", "Llama-3-8B Alpaca: the whole job",
        "Llama-3-8B, LoRA bf16, 2,000 Alpaca-like samples + 200 eval, batch 16, 10 epochs, transformers Trainer",
        "594.6 s for the whole job, 61 GB, one RTX PRO 6000 Server Edition",
        "method lora on the same samples, 10 epochs of packed budgeted steps, evaluated as a night does (before "
        "and after training)",
        ("the recipe's LoRA shape is not published: r=16 on q,v assumed for both sides",
         "the recipe evaluates once per epoch (assumed); ours twice (before and after, as a night)",
         "Llama-3.1-8B shapes (identical to Llama-3-8B's but for RoPE scaling); Alpaca-like lengths: log-normal, "
         "mean 117 tokens", "scaled down unless --alpaca-whole: a timed window of steps and one timed evaluation, "
         "extrapolated to the whole job (the row says how)", COMMON),
        "job_seconds"),
    "fixstars": Workload(
        "fixstars", "Fixstars: Qwen3, Unsloth QLoRA through TRL",
        "Qwen3-8B and Qwen3-32B, Unsloth QLoRA (r=8, all linear layers) through TRL's SFTTrainer, max_seq_length "
        "2048, batch 32 (8B: 4), padded, use_gradient_checkpointing=\"unsloth\"",
        "Qwen3-32B on an H100 SXM5: 27,000 / 9,200 samples/h (data sets of mean 117 / 861 tokens)",
        "method qlora: the same adapter, packed rows to a budget probed under --max-vram-gb (72 GB for the 32B), "
        "varlen attention, no checkpointing",
        ("ours packs and drops checkpointing where memory allows; the recipe pads to the longest sample and "
         "recomputes (offloaded) activations", "lora_alpha 16 and adamw_8bit (Unsloth's default) assumed",
         "both load the same NF4 checkpoint, built directly as NF4", COMMON),
        "samples_per_hour"),
    "full": Workload(
        "full", "Full fine-tuning of an 8B under 48 GB",
        "8B full fine-tuning with Unsloth (full_finetuning=True, adamw_8bit, Unsloth checkpointing) through TRL's "
        "SFTTrainer on one 48 GB GPU", "fits 48 GB",
        "method full: Unsloth's full fine-tuning, the optimizer chosen from memory (8-bit AdamW stepped in the "
        "backward pass for an 8B under 48 GB), packed rows to a budget probed under the cap",
        ("the 48 GB is a hard cap of each process's CUDA allocator (torch.cuda.set_per_process_memory_fraction)",
         "ours steps each weight in the backward pass (no gradient clipping); the recipe holds every gradient",
         "MFU counts 6 FLOPs per parameter per token (LoRA rows: 4)", COMMON),
        "real_tok_s"),
}


@dataclass(frozen=True)
class Spawn:
    stack: str
    arch: str
    build_4bit: bool
    update: dict[str, Any] = field(default_factory=dict)


def plan(s: BenchSettings) -> list[Spawn]:
    """The worker processes (a --deadline skips the last ones): the 8B's LoRA workloads, the first
    Fixstars model, full fine-tuning (the longest loads), then any further Fixstars model (the 32B)."""
    out: list[Spawn] = []
    if {"exxact", "alpaca"} & set(s.workloads):
        out += [Spawn("w_hf", s.llama_arch, False), Spawn("w_ours_lora", s.llama_arch, False)]
    fixstars = []
    if "fixstars" in s.workloads:
        for arch in s.fixstars_archs:
            cap = 72.0 if "32b" in arch and s.max_vram_gb == 40.0 else s.max_vram_gb
            fixstars.append([Spawn("w_fixstars", arch, True), Spawn("w_ours_qlora", arch, True, {"max_vram_gb": cap})])
    out += fixstars[0] if fixstars else []
    if "full" in s.workloads:
        out += [Spawn("w_ours_full", s.llama_arch, False), Spawn("w_full", s.llama_arch, False)]
    return out + [sp for pair in fixstars[1:] for sp in pair]


def run_workloads(s: BenchSettings) -> int:
    from jobs.bench.cli import spawn
    from jobs.bench.measure import smi_log
    from jobs.bench.model import resolve_model
    from jobs.bench.report import gpu_info, read_rows, write_result
    from jobs.bench.workload_report import document, summarise

    s.out.mkdir(parents=True, exist_ok=True)
    rows_path = s.out / "workloads.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    matmul: dict[str, int] = {}
    codes: dict[str, int | str] = {}
    t0 = time.time()
    with smi_log(s.smi_log, s.smi_fields):
        for sp in plan(s):
            left = s.deadline - (time.time() - t0) if s.deadline else 3600
            key = f"{sp.stack}:{sp.arch}"
            if left < 45:
                codes[key] = "skipped: no time left"
                continue
            ws = s.model_copy(update={"model": None, "arch": sp.arch, "build_4bit": sp.build_4bit, **sp.update})
            model = resolve_model(ws)  # built once: later spawns find its marker
            matmul[sp.arch] = model.matmul_params
            left = s.deadline - (time.time() - t0) if s.deadline else 3600
            codes[key] = spawn(sp.stack, ws, model.path, rows_path, max(30.0, left))
            if sp.stack == "w_ours_full" and s.full_ckpt == "auto" and _needs_ckpt(read_rows(rows_path)):
                codes[key + ":ckpt"] = spawn(sp.stack, ws.model_copy(update={"full_ckpt": "on"}), model.path,
                                             rows_path, max(30.0, s.deadline - (time.time() - t0) if s.deadline
                                                            else 3600))
    rows = summarise(read_rows(rows_path), matmul=matmul)
    doc = write_result(s.out / "workloads.json", mode="workloads", matmul_params=matmul, exit_codes=codes,
                       gpu=gpu_info(), settings=s.model_dump(mode="json"), seconds=round(time.time() - t0, 1),
                       rows=rows)
    text = document(rows, [WORKLOADS[w] for w in s.workloads], gpu=doc["gpu"], when=doc["when"])
    (s.out / "workloads.md").write_text(text)
    print(text)
    return 0 if rows else 1


def _needs_ckpt(rows: list[dict[str, Any]]) -> bool:
    """Ours' full fine-tuning found no step that fits without checkpointing (the parent then retries with it)."""
    ours = [r for r in rows if r.get("workload") == "full" and r.get("side") == "ours"]
    return bool(ours) and all("not even" in str(r.get("error", "")) for r in ours)
