"""Ours for the full fine-tuning workload: `[train] method = "full"` the nightshift way under the same hard
48 GB cap — Unsloth's full fine-tuning, the optimizer chosen from memory (jobs/training/optim.py: for an 8B
under 48 GB, bitsandbytes' 8-bit AdamW stepped in the backward pass, 32 GB of weights and states), packed
rows to a budget probed under the cap. Checkpointing: `--full-ckpt` (auto: off; the parent runs this
worker again with it on when not even one 2,048-token step fits).
"""

from __future__ import annotations

import time

from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import FULL_FLOPS, error_row, hard_cap, ours_window, write
from jobs.training.models.synthetic import CAP, make_samples

LABEL = "nightshift, method full (optimizer from memory, packed, budget from memory)"


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.config import TrainConfig
    from jobs.training.optim import build_optimizer, choose_for_model

    fraction = hard_cap(s.full_cap_gb)
    gc = "unsloth" if s.full_ckpt == "on" else False
    head = {"workload": "full", "side": "ours", "label": LABEL, "arch": s.arch, "flops": FULL_FLOPS,
            "grad_ckpt": gc or "off", "cap_gb": s.full_cap_gb, "cap_fraction": fraction}
    t0 = time.time()
    try:
        model, _tok, info = load_unsloth(job.model, lora=LoraSpec(), method="full", max_seq_length=s.max_budget,
                                         gradient_checkpointing=gc, cache_dir=s.state_dir)
        cfg = TrainConfig(method="full")
        choice = choose_for_model(model, cfg, device="cuda", max_vram_gb=s.full_cap_gb)
        opt = build_optimizer(model, cfg, choice, device="cuda")
    except Exception as e:
        write(job, profile=s.profiles[0], **head, **error_row(e), fits=False)
        return
    load_s = time.time() - t0
    for prof in s.profiles:
        samples = make_samples(prof, s.data_tokens * 3, vocab=vocab_size(job.model), seed=s.seed)
        try:
            row = ours_window(model, samples, s, opt, max_vram_gb=s.full_cap_gb, min_tokens=CAP)
            row["fits"] = "error" not in row
        except Exception as e:
            row = {**error_row(e), "fits": False}
        write(job, profile=prof, **head, **row, load_seconds=round(load_s, 1), optimizer=choice.as_info(),
              packed_attention=info.get("packed_attention"), trainable_parameters=info.get("trainable_parameters"))
        torch.cuda.empty_cache()
