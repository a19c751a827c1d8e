"""Ours for the Fixstars workload: `[train] method = "qlora"` the nightshift way — the same adapter
(r=8 on every linear layer), packed rows to a token budget probed under `--max-vram-gb`, varlen
attention, checkpointing off unless `--ours-ckpt`."""

from __future__ import annotations

import time

from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import LORA_FLOPS, frozen_base_compute, ours_window, write
from jobs.training.models.synthetic import CAP, make_samples


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.step import make_optimizer

    t0 = time.time()
    gc = "unsloth" if s.ours_ckpt else False
    model, tok, info = load_unsloth(job.model, lora=LoraSpec(r=8, alpha=16), method="qlora",
                                    max_seq_length=s.max_budget, gradient_checkpointing=gc, cache_dir=s.state_dir)
    label = frozen_base_compute("nightshift, method qlora (packed, budget from memory)", model, tok, s, job, info)
    load_s = time.time() - t0
    for prof in s.profiles:
        samples = make_samples(prof, s.data_tokens * 3, vocab=vocab_size(job.model), seed=s.seed)
        row = ours_window(model, samples, s, make_optimizer(model), max_vram_gb=s.max_vram_gb, min_tokens=CAP)
        write(job, workload="fixstars", side="ours", label=label, arch=s.arch, flops=LORA_FLOPS, profile=prof,
              grad_ckpt=gc or "off", max_vram_gb=s.max_vram_gb, compute=info["compute"],
              load_seconds=round(load_s, 1), trainable_parameters=info.get("trainable_parameters"), **row)
        torch.cuda.empty_cache()
