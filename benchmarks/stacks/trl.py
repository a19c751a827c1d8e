"""trl: Unsloth + TRL SFTTrainer at its best — padding_free with a large batch, and packing=True.

Steps are timed by a trainer callback; the collator is wrapped to count each batch's real tokens
and samples. An out-of-memory or an API change in a peer stack is a result row, not a crash.
"""

from __future__ import annotations

from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job, load_ours
from benchmarks.stacks.wcommon import sft_window
from jobs.training.models.synthetic import CAP, make_samples


def configs(s: BenchSettings, big_card: bool) -> list[tuple[str, dict[str, Any], dict[str, int], str | bool]]:
    """(name, SFTConfig kwargs, batch per profile, gradient checkpointing) of the configurations asked for."""
    pack_batch = 4 if big_card else 2  # > 100 GB cards hold 4 rows of trl_pack_length
    all_ = [
        ("padding_free", {"padding_free": True, "max_length": CAP}, {"alpaca": 32, "wiki": 16}, "unsloth"),
        ("packing", {"packing": True, "max_length": s.trl_pack_length}, {"alpaca": pack_batch, "wiki": pack_batch},
         False),
    ]
    return [c for c in all_ if c[0] in s.trl_configs]


def run(s: BenchSettings, job: Job) -> None:
    import torch

    big = torch.cuda.get_device_properties(0).total_memory > 100e9
    model = None
    for name, kw, batches, gc in configs(s, big):
        # checkpointing is chosen at load: for_training(use_gradient_checkpointing=False) on a model
        # loaded with "unsloth" kept the offloaded checkpointing (seen: 10 GB for 16k tokens/step)
        del model
        torch.cuda.empty_cache()
        model, tok, info = load_ours(s, job.model, gc=gc, cache=False, max_seq=s.trl_pack_length, varlen=False)
        for prof in s.profiles:
            win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
            try:
                torch.cuda.reset_peak_memory_stats()
                data = _train(s, job, model, tok, prof, batches[prof], kw, win)
                row = {**win.result(data), **peak_gb()}
            except Exception as e:  # an OOM or API change in a peer stack is a result, not a crash
                row = {"error": f"{type(e).__name__}: {e}"[:400], **peak_gb()}
                torch.cuda.empty_cache()
            append_row(
                job.rows,
                {
                    "stack": "trl",
                    "label": f"Unsloth + TRL, {name}",
                    "profile": prof,
                    "batch": f"{batches[prof]}" + (f" x {kw['max_length']}" if name == "packing" else ""),
                    "grad_ckpt": gc or "off",
                    **row,
                    "load_seconds": info["load_seconds"],
                    "first_step_s": win.first_step_s(job.t_launch),
                },
            )


def _train(s: BenchSettings, job: Job, model: Any, tok: Any, prof: str, bs: int, kw: dict[str, Any],
           win: Window) -> list[Any]:
    """SFTTrainer over random samples of `prof` until the window is complete; the samples drawn from."""
    samples = make_samples(prof, s.data_tokens * 2, vocab=vocab_size(job.model), seed=s.seed)
    sft_window(model, tok, samples, win, batch=bs, seed=s.seed, optim="adamw_torch_fused", **kw)
    return samples
