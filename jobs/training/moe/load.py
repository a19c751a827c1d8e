"""nightshift's training path for a mixture-of-experts model held in memory (jobs/training/moe/build.py).

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

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from jobs.training.backends.unsloth_lora import parameter_counts  # imports no GPU stack
from jobs.training.loaded import Loaded, load_tokenizer
from jobs.training.models.architectures import MARKER, matmul_params
from jobs.training.moe import packed_attention
from jobs.training.moe.experts_nf4 import route_lora
from jobs.training.moe.lora import expected_lora_parameters, lora_targets

log = structlog.get_logger("nightshift.train")


def prepare_moe_for_training(model: Any, tokenizer: Any, *, r: int = 16, alpha: int = 16, dropout: float = 0.0,
                             target_modules: list[str] | str = "all-linear", gradient_checkpointing: bool = False,
                             seed: int = 0, build_info: dict[str, Any] | None = None,
                             adapter: Path | None = None) -> Loaded:
    """LoRA (a new adapter, or `adapter` continued) + packed attention + optional checkpointing on an
    in-memory model."""
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # an older torchao beside Unsloth makes PEFT refuse every LoRA
    from peft import LoraConfig, PeftModel, get_peft_model

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    attn = packed_attention.use_packed_attention(model)
    targets = lora_targets(model, target_modules)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        pcfg = model.peft_config["default"]
        r, alpha = int(pcfg.r), int(pcfg.lora_alpha)
        targets = {"target_modules": sorted(pcfg.target_modules or []),
                   "target_parameters": list(getattr(pcfg, "target_parameters", None) or [])}
    else:
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
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
        "parent_adapter": str(adapter) if adapter is not None else None,
        "experts_routed_through_grouped_gemm": routed, "attention": attn,
        "gradient_checkpointing": gradient_checkpointing, "peft_seconds": round(time.perf_counter() - t0, 2),
    }
    log.info("moe_model_ready", **{k: v for k, v in info.items() if not isinstance(v, dict)})
    return Loaded(model, tokenizer, "nightshift-moe", device.type, info)


# ---- a night from an in-memory model ----------------------------------------------------------------


def in_memory_arch(model_path: Path) -> str | None:
    """The architecture a model directory stands for when its weights are built in memory each night
    (`[model] build = "in-memory:<arch>"`: the directory holds config, tokenizer and marker only)."""
    try:
        meta = json.loads((Path(model_path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("arch") if meta.get("in_memory") else None


def write_in_memory_stub(arch: str, out_dir: Path) -> Path:
    """config.json, the tokenizer and the marker of an in-memory model (kilobytes), written atomically."""
    from jobs.training.models.architectures import make_config, make_tokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        config = make_config(arch)
        config.save_pretrained(tmp)
        make_tokenizer(config).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"arch": arch, "in_memory": True, "seed": 0,
                                              "matmul_params": matmul_params(config)}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_in_memory(model_path: Path, cfg: Any, *, adapter: Path | None, gradient_checkpointing: bool) -> Loaded:
    """The night's load for an in-memory base (jobs.training.load calls it): build, then LoRA."""
    from jobs.training.moe.build import build_random_in_memory

    arch = in_memory_arch(model_path)
    if arch is None:
        raise ValueError(f"{model_path}: not an in-memory model (no {MARKER} with in_memory)")
    model, _tok, info = build_random_in_memory(arch, seed=0)
    return prepare_moe_for_training(model, load_tokenizer(model_path), r=cfg.lora_rank, alpha=cfg.lora_alpha,
                                    dropout=cfg.lora_dropout, target_modules=cfg.target_modules,
                                    gradient_checkpointing=gradient_checkpointing, seed=cfg.seed,
                                    build_info=info, adapter=adapter)
