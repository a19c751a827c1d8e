"""The publications' HF transformers LoRA bf16 recipe, for two workloads on one loaded model:

- exxact: Llama-3.1-8B, transformers Trainer + PEFT LoRA r=16 on q_proj, v_proj, bf16 base, sequences of
  512 tokens, batch 2, 60 steps (published: 4,962 tok/s on one RTX PRO 6000 Server Edition);
- alpaca: Llama-3-8B LoRA bf16, 2,000 Alpaca-like samples + 200 eval, batch 16, 10 epochs, transformers
  Trainer (published: 594.6 s for the whole job, 61 GB). Run whole (`--alpaca-whole`) or as a timed
  window of steps and one timed evaluation, extrapolated: load + 1,250 steps x the mean step + 10 evaluations
  (once per epoch: the publication does not say how often it evaluated).

Unpublished details assumed: lora_alpha 32, dropout 0.05, learning rate 2e-4, Trainer defaults (AdamW fused,
linear schedule, no gradient checkpointing), SDPA attention, padding to the longest sample of the batch.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Any

from benchmarks.measure import Window, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import (
    LORA_FLOPS,
    as_dataset,
    collate,
    fixed_samples,
    profile_samples,
    timed,
    trainer_timer,
    write,
)

LABEL = "HF transformers Trainer + PEFT, LoRA bf16 r=16 on q,v"
TARGETS = ["q_proj", "v_proj"]


def load(job: Job) -> Any:
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # the torchao beside Unsloth is older than PEFT accepts; this stack uses none
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(job.model), dtype=torch.bfloat16, device_map={"": 0},
                                                 attn_implementation="sdpa", local_files_only=True)
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS,
                                            task_type="CAUSAL_LM"))


def trainer(model: Any, samples: list, counts: list, s: BenchSettings, *, batch: int, evals: list | None = None,
            **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-"), per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        learning_rate=2e-4, bf16=True, logging_steps=10**6, save_strategy="no", report_to="none",
        remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0, seed=s.seed, disable_tqdm=True,
        **args)
    return Trainer(model=model, args=targs, train_dataset=as_dataset(samples),
                   eval_dataset=as_dataset(evals) if evals else None, data_collator=lambda f: collate(f, counts))


def run(s: BenchSettings, job: Job) -> None:
    import torch

    t0 = time.time()
    model = load(job)
    load_s = time.time() - t0
    vocab = vocab_size(job.model)
    if "exxact" in s.workloads:
        counts: list[tuple[int, int]] = []
        win = Window(warmup=s.warmup, max_steps=s.exxact_steps - s.warmup, seconds=1e9)  # the recipe's 60 steps
        tr = trainer(model, fixed_samples(2 * s.exxact_steps, 512, vocab=vocab, seed=s.seed), counts, s, batch=2,
                     max_steps=s.exxact_steps)
        tr.add_callback(trainer_timer(win, counts))
        torch.cuda.reset_peak_memory_stats()
        out = tr.train()
        runtime = float(out.metrics["train_runtime"])
        write(job, workload="exxact", side="publication", label=LABEL, arch=s.arch, flops=LORA_FLOPS,
              profile="512-token sequences", batch="2 x 512", grad_ckpt="off", **win.result(), **peak_gb(),
              load_seconds=round(load_s, 1), recipe_steps=s.exxact_steps,
              whole_run_tok_s=2 * 512 * s.exxact_steps / runtime, train_runtime_s=round(runtime, 2))
    if "alpaca" in s.workloads:
        alpaca(model, s, job, vocab, load_s)


def alpaca(model: Any, s: BenchSettings, job: Job, vocab: int, load_s: float) -> None:
    import torch

    train = profile_samples("alpaca", s.alpaca_samples, vocab=vocab, seed=s.seed)
    evals = profile_samples("alpaca", s.alpaca_eval, vocab=vocab, seed=s.seed + 1)
    steps_total = math.ceil(len(train) / 16) * s.alpaca_epochs
    counts: list[tuple[int, int]] = []
    torch.cuda.reset_peak_memory_stats()
    if s.alpaca_whole:
        tr = trainer(model, train, counts, s, batch=16, evals=evals, num_train_epochs=s.alpaca_epochs,
                     eval_strategy="epoch" if evals else "no")
        seconds, _ = timed(tr.train)
        tokens = s.alpaca_epochs * sum(x.n_tokens for x in train)
        row = {"real_tok_s": tokens / seconds, "job_seconds": round(load_s + seconds, 1), "job_basis": "measured",
               "train_and_eval_seconds": round(seconds, 1)}
    else:
        win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        tr = trainer(model, train, counts, s, batch=16, max_steps=s.warmup + s.max_steps)
        tr.add_callback(trainer_timer(win, counts))
        tr.train()
        row = win.result(train)
        eval_s, _ = timed(lambda: tr.evaluate(eval_dataset=as_dataset(evals))) if evals else (0.0, None)
        step_s = row["timed_seconds"] / max(1, row["timed_steps"])
        row.update(job_seconds=round(load_s + steps_total * step_s + s.alpaca_epochs * eval_s, 1),
                   job_basis=(f"extrapolated: load {load_s:.1f} s + {steps_total} steps x {step_s:.3f} s (mean of "
                              f"{row['timed_steps']} timed) + {s.alpaca_epochs} evaluations x {eval_s:.2f} s"),
                   eval_seconds=round(eval_s, 2))
    write(job, workload="alpaca", side="publication", label="HF transformers Trainer + PEFT, LoRA bf16 (r=16 q,v)",
          arch=s.arch, flops=LORA_FLOPS, profile=f"alpaca, {len(train)} + {len(evals)} eval, {s.alpaca_epochs} epochs",
          batch="16 padded", grad_ckpt="off", **row, **peak_gb(), load_seconds=round(load_s, 1),
          steps_total=steps_total)
