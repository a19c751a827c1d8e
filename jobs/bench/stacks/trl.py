"""trl: Unsloth + TRL SFTTrainer at its best — padding_free with a large batch, and packing=True.

Steps are timed by a trainer callback; the collator is wrapped to count each batch's real tokens
and samples. An out-of-memory or an API change in a peer stack is a result row, not a crash.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from jobs.bench.measure import Window, append_row, peak_gb
from jobs.bench.model import vocab_size
from jobs.bench.settings import BenchSettings
from jobs.bench.stacks.common import Job, load_ours
from jobs.training.synthetic import CAP, make_samples


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
                _train(s, job, model, tok, prof, batches[prof], kw, win)
                row = {**win.result(), **peak_gb()}
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
           win: Window) -> None:
    """SFTTrainer over random samples of `prof` until the window is complete."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    samples = make_samples(prof, s.data_tokens * 2, vocab=vocab_size(job.model), seed=s.seed)
    ds = Dataset.from_dict({"input_ids": [x.input_ids for x in samples]})
    counts: list[tuple[int, int]] = []  # (real tokens, samples) per batch, as the collator built them

    class Timer(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args, state, control, **k):
            torch.cuda.synchronize()
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **k):
            torch.cuda.synchronize()
            now = time.perf_counter()
            i = state.global_step - 1
            toks, n = counts[i] if i < len(counts) else (0, 0)
            if win.step_done(now - self.last, toks, n):
                control.should_training_stop = True
            self.last = now

    cfg = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=1,
        max_steps=s.warmup + s.max_steps + 2,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        bf16=True,
        optim="adamw_torch_fused",
        seed=s.seed,
        dataloader_num_workers=0,
        dataset_num_proc=1,
        completion_only_loss=False,
        gradient_checkpointing=False,
        **kw,
    )
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    inner = trainer.data_collator

    def counting(features):
        b = inner(features)
        ids = b["input_ids"]
        toks = int(b["attention_mask"].sum()) if "attention_mask" in b else int(ids.numel())
        n = int((b["position_ids"] == 0).sum()) if "position_ids" in b else int(ids.shape[0])
        counts.append((toks, n))
        return b

    trainer.data_collator = counting
    trainer.add_callback(Timer())
    trainer.train()
