"""baseline: HF transformers + PEFT + bitsandbytes QLoRA, the way the PEFT docs do it.

NF4 base (unless the checkpoint is already quantised), gradient checkpointing on, SDPA attention,
batch 4 padded.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job, padded_rows
from jobs.training.models.synthetic import make_samples


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # the torchao beside Unsloth is older than PEFT accepts; this stack uses none
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from jobs.training.models.architectures import bnb_config

    t0 = time.time()
    kw: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "device_map": {"": 0},
        "local_files_only": True,
        "attn_implementation": "sdpa",
    }
    if not json.loads((job.model / "config.json").read_text()).get("quantization_config"):
        kw["quantization_config"] = bnb_config()
    model = AutoModelForCausalLM.from_pretrained(str(job.model), **kw)
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model = get_peft_model(
        model,
        LoraConfig(
            r=s.lora_r,
            lora_alpha=s.lora_r,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    model.config.use_cache = False
    load_s = time.time() - t0
    for prof in s.profiles:
        samples = make_samples(prof, s.data_tokens, vocab=vocab_size(job.model), seed=s.seed)
        torch.cuda.reset_peak_memory_stats()
        win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
        padded_rows(model, samples, win, pad_id=0, batch_size=4)
        append_row(
            job.rows,
            {
                "stack": "baseline",
                "label": "HF transformers + PEFT + bitsandbytes",
                "profile": prof,
                "batch": "4 padded",
                "grad_ckpt": "on",
                **win.result(samples),
                **peak_gb(),
                "load_seconds": round(load_s, 1),
                "first_step_s": win.first_step_s(job.t_launch),
            },
        )
