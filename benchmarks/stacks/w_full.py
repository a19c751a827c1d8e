"""The full fine-tuning claim: an 8B fully fine-tuned with Unsloth on one 48 GB GPU. Its recipe as Unsloth
documents it: `full_finetuning=True` (FastModel; bf16 weights without an fp32 master copy),
use_gradient_checkpointing="unsloth", TRL's SFTTrainer with Unsloth's defaults (adamw_8bit, batch 4,
padding-free where Unsloth turns it on), max_length 2048. The 48 GB is a hard cap of this process's CUDA
allocator (`--full-cap-gb`): a step past it is an out-of-memory, as on a 48 GB card, and is the row's result.
"""

from __future__ import annotations

import time

from benchmarks.measure import Window, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import FULL_FLOPS, error_row, hard_cap, sft_window, write
from jobs.training.models.synthetic import make_samples

LABEL = "Unsloth full fine-tuning + TRL SFTTrainer (adamw_8bit, batch 4)"


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.unsloth import LoraSpec, load_unsloth

    fraction = hard_cap(s.full_cap_gb)
    head = {"workload": "full", "side": "publication", "label": LABEL, "arch": s.arch, "flops": FULL_FLOPS,
            "batch": "4", "grad_ckpt": "unsloth", "cap_gb": s.full_cap_gb, "cap_fraction": fraction}
    t0 = time.time()
    try:
        model, tok, info = load_unsloth(job.model, lora=LoraSpec(), method="full", max_seq_length=2048,
                                        gradient_checkpointing="unsloth", cache_dir=None, varlen=False)
    except Exception as e:  # not even the load fits the cap
        write(job, profile=s.profiles[0], **head, **error_row(e))
        return
    load_s = time.time() - t0
    for prof in s.profiles:
        win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        torch.cuda.reset_peak_memory_stats()
        try:
            data = make_samples(prof, s.data_tokens, vocab=vocab_size(job.model), seed=s.seed)
            used = sft_window(model, tok, data, win, batch=4, seed=s.seed, max_length=2048, optim="adamw_8bit")
            row = {**win.result(data), **peak_gb(), "trainer": used, "fits": True}
        except Exception as e:
            row = {**error_row(e), "fits": False}
        write(job, profile=prof, **head, **row, load_seconds=round(load_s, 1),
              trainable_parameters=info.get("trainable_parameters"))
