"""Ours for the exxact and alpaca workloads: `[train] method = "lora"` the nightshift way — the 8B in bf16
through Unsloth (load_in_4bit=False), the publications' adapter (r=16 on q,v), packed rows (no attention
across samples) to a token budget probed under `--max-vram-gb`, no gradient checkpointing.

alpaca: the same 2,000 samples x 10 epochs, evaluated as a night does (before and after: 2 passes over the
200 held-out samples), whole (`--alpaca-whole`) or extrapolated from the timed window like the recipe.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import (
    LORA_FLOPS,
    fixed_samples,
    frozen_base_compute,
    ours_window,
    profile_samples,
    timed,
    write,
)

LABEL = "nightshift, method lora (bf16 base, packed, budget from memory)"


def load(s: BenchSettings, job: Job) -> tuple[Any, dict[str, Any], str]:
    """The model, its load info and its label (with `--compute fp8`: the frozen base on FP8, checked)."""
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth

    model, tok, info = load_unsloth(job.model, lora=LoraSpec(r=16, alpha=32, target_modules=["q_proj", "v_proj"]),
                                    method="lora", max_seq_length=s.max_budget, gradient_checkpointing=False,
                                    cache_dir=s.state_dir, cache_base=False)
    return model, info, frozen_base_compute(LABEL, model, tok, s, job, info)


def optimizer(model: Any) -> Any:
    from jobs.training.config import TrainConfig
    from jobs.training.optim import build_optimizer

    return build_optimizer(model, TrainConfig(method="lora"), None, device="cuda")


def run(s: BenchSettings, job: Job) -> None:
    t0 = time.time()
    model, info, label = load(s, job)
    load_s = time.time() - t0
    vocab = vocab_size(job.model)
    common = {"arch": s.arch, "flops": LORA_FLOPS, "grad_ckpt": "off", "load_seconds": round(load_s, 1),
              "max_vram_gb": s.max_vram_gb, "load": info, "compute": info["compute"]}
    if "exxact" in s.workloads:
        row = ours_window(model, fixed_samples(400, 512, vocab=vocab, seed=s.seed), s, optimizer(model),
                          max_vram_gb=s.max_vram_gb, min_tokens=512)
        write(job, workload="exxact", side="ours", label=label, profile="512-token sequences", **common, **row)
    if "alpaca" in s.workloads:
        alpaca(model, s, job, vocab, load_s, common, label)


def alpaca(model: Any, s: BenchSettings, job: Job, vocab: int, load_s: float, common: dict[str, Any],
           label: str) -> None:
    from jobs.learning.evaluate import eval_metrics

    train = profile_samples("alpaca", s.alpaca_samples, vocab=vocab, seed=s.seed)
    evals = profile_samples("alpaca", s.alpaca_eval, vocab=vocab, seed=s.seed + 1, start=len(train))
    longest = max(x.n_tokens for x in train)
    opt = optimizer(model)

    def evaluate() -> float:
        return timed(lambda: eval_metrics(model, evals, pad_id=0, device="cuda", max_tokens_per_batch=8192))[0] \
            if evals else 0.0

    row = ours_window(model, train, s, opt, max_vram_gb=s.max_vram_gb, min_tokens=longest)
    tokens = s.alpaca_epochs * sum(x.n_tokens for x in train)
    if row.get("real_tok_s"):
        if s.alpaca_whole:
            seconds = whole_job(model, train, s, opt, row["token_budget"], evaluate)
            row.update(job_seconds=round(load_s + seconds, 1), job_basis="measured",
                       train_and_eval_seconds=round(seconds, 1), real_tok_s=tokens / seconds)
        else:
            eval_s = evaluate()
            row.update(job_seconds=round(load_s + tokens / row["real_tok_s"] + 2 * eval_s, 1), eval_seconds=eval_s,
                       job_basis=(f"extrapolated: load {load_s:.1f} s + {tokens:,} tokens at the timed "
                                  f"{row['real_tok_s']:,.0f} tok/s + 2 evaluations x {eval_s:.2f} s (before, after)"))
    write(job, workload="alpaca", side="ours", label=label,
          profile=f"alpaca, {len(train)} + {len(evals)} eval, {s.alpaca_epochs} epochs", **common, **row)


def whole_job(model: Any, train: list, s: BenchSettings, opt: Any, budget: int, evaluate: Any) -> float:
    """The whole job as a night runs it: evaluate, every epoch (later ones shuffled) in packed steps, evaluate."""
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.step import train_step

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    evaluate()
    for epoch in range(s.alpaca_epochs):
        order = list(train)
        if epoch:
            random.Random(s.seed + epoch).shuffle(order)
        for b in packed_batches(order, tokens_per_step=budget):
            train_step(model, b, opt)
    evaluate()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
