"""nightshift's training path for a mixture-of-experts model held in memory (jobs/training/build_in_memory.py).

From a transformers model object (4-bit attention, NF4 frozen experts) to the `Loaded` the step, the
loop, the probe and the benchmark take:
- LoRA on attention and on every expert's projections (`moe.lora_targets`: PEFT target_modules plus
  target_parameters), the expert factors routed through grouped GEMMs (`experts_nf4.route_lora`);
- packed rows with no attention across samples, sinks and sliding windows kept (`packed_attention`);
- gradient checkpointing (transformers' non-reentrant) only when asked: the token budget of a step is
  chosen from measured memory by the caller (jobs.training.probe), so most of the time it is off.
Imports of torch, peft and bitsandbytes stay inside functions.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from jobs.training import packed_attention
from jobs.training.experts_nf4 import route_lora
from jobs.training.load import Loaded
from jobs.training.moe import expected_lora_parameters, lora_targets
from jobs.training.unsloth_backend import parameter_counts  # imports no GPU stack

log = structlog.get_logger("nightshift.train")


def prepare_moe_for_training(model: Any, tokenizer: Any, *, r: int = 16, alpha: int = 16,
                             target_modules: list[str] | str = "all-linear", gradient_checkpointing: bool = False,
                             seed: int = 0, build_info: dict[str, Any] | None = None) -> Loaded:
    """LoRA (new adapter) + packed attention + optional checkpointing on an in-memory model."""
    import torch
    from peft import LoraConfig, get_peft_model

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    attn = packed_attention.use_packed_attention(model)
    targets = lora_targets(model, target_modules)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             **targets))
    routed = route_lora(model)
    model.train()
    device = next(p.device for p in model.parameters() if p.requires_grad)
    counts = parameter_counts(model)
    expected = expected_lora_parameters(model.config, r)
    info: dict[str, Any] = {
        "backend": "nightshift-moe", **(build_info or {}), **counts,
        "expected_trainable": expected,
        "trainable_matches_expected": bool(expected) and expected["total"] == counts["trainable_parameters"],
        "lora": {"r": r, "alpha": alpha, "target_modules": targets["target_modules"],
                 "target_parameters": targets.get("target_parameters", [])},
        "experts_routed_through_grouped_gemm": routed, "attention": attn,
        "gradient_checkpointing": gradient_checkpointing, "peft_seconds": round(time.perf_counter() - t0, 2),
    }
    log.info("moe_model_ready", **{k: v for k, v in info.items() if not isinstance(v, dict)})
    return Loaded(model, tokenizer, "nightshift-moe", device.type, info)
