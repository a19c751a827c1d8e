"""unsloth: Unsloth's defaults — its offloaded gradient checkpointing, batch 4 padded, attention as shipped."""

from __future__ import annotations

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job, load_ours, padded_rows
from jobs.training.models.synthetic import CAP, make_samples


def run(s: BenchSettings, job: Job) -> None:
    import torch

    model, tok, info = load_ours(s, job.model, gc="unsloth", cache=False, max_seq=CAP, varlen=False)
    for prof in s.profiles:
        samples = make_samples(prof, s.data_tokens, vocab=vocab_size(job.model), seed=s.seed)
        torch.cuda.reset_peak_memory_stats()
        win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        padded_rows(model, samples, win, pad_id=tok.pad_token_id or 0, batch_size=4)
        append_row(
            job.rows,
            {
                "stack": "unsloth",
                "label": "Unsloth defaults",
                "profile": prof,
                "batch": "4 padded",
                "grad_ckpt": "unsloth",
                **win.result(samples),
                **peak_gb(),
                "load_seconds": info["load_seconds"],
                "first_step_s": win.first_step_s(job.t_launch),
                "trainable_parameters": info["trainable_parameters"],
            },
        )
