"""trl_liger: what many users pick instead of Unsloth — HF transformers + bitsandbytes NF4 + PEFT LoRA through
TRL's SFTTrainer with Liger Kernel on (`use_liger_kernel=True`, Liger's documented switch for SFT), packed.

Liger patches the Llama/Qwen modules with its Triton RoPE, RMSNorm and SwiGLU kernels. Its fused linear
cross-entropy is the one Liger kernel TRL 1.15 refuses (`liger_kernel_config={"fused_linear_cross_entropy":
True}` raises: the trainer replaces the model's forward with its own fused LM head, which computes the loss in
chunks without the whole logits, the same saving), so the head is TRL's. The LoRA goes on through the trainer's
`peft_config` (r = --lora-r, alpha = r, every projection), which also casts the adapter to bf16 for a 4-bit base.
The shape is the Unsloth + TRL `packing` row's: rows of --trl-pack-length tokens, 4 a step on a card over
100 GB (2 below), checkpointing off, fused AdamW; 2 rows a step after an out-of-memory.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from benchmarks.stacks.wcommon import sft_window
from jobs.training.backends.unsloth_lora import DEFAULT_TARGETS
from jobs.training.models.synthetic import make_samples

LABEL = "TRL + Liger Kernel (HF + PEFT + bitsandbytes NF4), packing"


def load(job: Job) -> tuple[Any, Any]:
    """The NF4 base as the PEFT docs load it (a checkpoint already in 4 bits as it is), and its tokenizer."""
    import json

    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # the torchao beside Unsloth is older than PEFT accepts; this stack uses none
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobs.training.models.architectures import bnb_config

    kw: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": {"": 0}, "local_files_only": True,
                          "attn_implementation": "sdpa"}
    if not json.loads((job.model / "config.json").read_text()).get("quantization_config"):
        kw["quantization_config"] = bnb_config()
    model = AutoModelForCausalLM.from_pretrained(str(job.model), **kw)
    model.config.use_cache = False
    tok = AutoTokenizer.from_pretrained(str(job.model), local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def run(s: BenchSettings, job: Job) -> None:
    import liger_kernel  # noqa: F401  (missing: the worker's error says so before any model is built)
    import torch

    big = torch.cuda.get_device_properties(0).total_memory > 100e9
    rows = 4 if big else 2
    for prof in s.profiles:
        samples = make_samples(prof, s.data_tokens * 2, vocab=vocab_size(job.model), seed=s.seed)
        while True:
            # a fresh base a window: the trainer patches the model it gets (the LoRA, TRL's fused LM head), and a
            # second trainer on the unloaded base failed ('LlamaModel' has no 'prepare_inputs_for_generation')
            t0 = time.time()
            model, tok = load(job)
            load_s = round(time.time() - t0, 1)
            from peft import LoraConfig  # after load(): PEFT imported only once the torchao check is hidden

            lora = LoraConfig(r=s.lora_r, lora_alpha=s.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                              target_modules=list(DEFAULT_TARGETS))
            win = Window(warmup=s.warmup, max_steps=s.max_steps, seconds=s.seconds)
            try:
                torch.cuda.reset_peak_memory_stats()
                used = sft_window(model, tok, samples, win, batch=rows, seed=s.seed, peft_config=lora,
                                  packing=True, max_length=s.trl_pack_length, use_liger_kernel=True,
                                  optim="adamw_torch_fused")
                row = {**win.result(samples), **peak_gb(), "trainer": used}
            except Exception as e:  # an OOM or API change in a peer stack is a result, not a crash
                row = {"error": f"{type(e).__name__}: {e}"[:400], **peak_gb()}
            del model
            gc.collect()
            torch.cuda.empty_cache()
            oom = "OutOfMemory" in str(row.get("error", ""))
            append_row(job.rows, {"stack": "trl_liger", "label": LABEL, "profile": prof,
                                  "batch": f"{rows} x {s.trl_pack_length}", "grad_ckpt": "off", **row,
                                  "load_seconds": load_s, "first_step_s": win.first_step_s(job.t_launch)})
            if not (oom and rows > 1):
                break
            rows //= 2
