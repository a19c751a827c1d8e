"""The Fixstars recipe: Qwen3-8B / Qwen3-32B, Unsloth QLoRA (r=8 on every linear layer) through TRL's
SFTTrainer, max_seq_length 2048, batch 32 (8B: 4), padded (neither packing nor padding-free),
use_gradient_checkpointing="unsloth" (published, Qwen3-32B on an H100 SXM5: 27,000 / 9,200 samples/h
on data sets of mean 117 / 861 tokens). Unpublished details assumed: lora_alpha 16, Unsloth's default
optimizer (adamw_8bit), learning rate 2e-4.
"""

from __future__ import annotations

import time

from benchmarks.measure import Window, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import LORA_FLOPS, error_row, sft_window, write
from jobs.training.models.synthetic import make_samples


def batch_of(arch: str | None) -> int:
    return 4 if arch and "8b" in arch else 32


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.unsloth import LoraSpec, load_unsloth

    t0 = time.time()
    model, tok, info = load_unsloth(job.model, lora=LoraSpec(r=8, alpha=16), method="qlora", max_seq_length=2048,
                                    gradient_checkpointing="unsloth", cache_dir=None, cache_base=False, varlen=False)
    load_s = time.time() - t0
    batch = batch_of(s.arch)
    for prof in s.profiles:
        win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        torch.cuda.reset_peak_memory_stats()
        try:
            data = make_samples(prof, s.data_tokens, vocab=vocab_size(job.model), seed=s.seed)
            used = sft_window(model, tok, data, win, batch=batch, seed=s.seed, padding_free=False, packing=False,
                              max_length=2048, optim="adamw_8bit")
            row = {**win.result(data), **peak_gb(), "trainer": used}
        except Exception as e:
            row = error_row(e)
        write(job, workload="fixstars", side="publication", label="Unsloth QLoRA r=8 + TRL SFTTrainer, padded",
              arch=s.arch, flops=LORA_FLOPS, profile=prof, batch=f"{batch} padded", grad_ckpt="unsloth", **row,
              load_seconds=round(load_s, 1), trainable_parameters=info.get("trainable_parameters"))
