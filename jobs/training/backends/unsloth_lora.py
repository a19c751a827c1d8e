"""Unsloth's LoRA on a loaded base: the second half of a load (jobs/training/backends/unsloth.py), and all of
one where a night of several adapters holds the base from the adapter before (jobs/training/resident.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jobs.training.backends.unsloth import LoraSpec, load_adapter_weights, parameter_counts


def attach_lora(model: Any, tokenizer: Any, *, lora: LoraSpec, parent_adapter: Path | str | None,
                gc_arg: bool | str, max_seq_length: int, info: dict[str, Any],
                t0: float) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info): the LoRA put on `model` (the parent's shape and weights when continuing)
    and the model made ready to train. `t0`: when the load began (info's load_seconds)."""
    from unsloth import FastLanguageModel

    from jobs.training.step import UNSLOTH_FLAG

    # the parent's shape when continuing, else the configured one
    spec = lora
    if parent_adapter is not None:
        pcfg = json.loads((Path(parent_adapter) / "adapter_config.json").read_text())
        tm = pcfg.get("target_modules") or lora.modules()
        tm = sorted(tm) if isinstance(tm, list | set) else tm
        spec = LoraSpec(
            r=int(pcfg.get("r", lora.r)),
            alpha=int(pcfg.get("lora_alpha", lora.alpha)),
            dropout=float(pcfg.get("lora_dropout", lora.dropout)),
            target_modules=tm,
            seed=lora.seed,
        )
    t3 = time.perf_counter()
    model = FastLanguageModel.get_peft_model(
        model,
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.modules(),
        bias="none",
        use_gradient_checkpointing=gc_arg,
        random_state=spec.seed,
        max_seq_length=max_seq_length,
    )
    if parent_adapter is not None:
        info["parent_adapter"] = str(parent_adapter)
        info["parent_keys_loaded"] = load_adapter_weights(model, Path(parent_adapter))
    info["peft_seconds"] = round(time.perf_counter() - t3, 2)
    FastLanguageModel.for_training(model, use_gradient_checkpointing=gc_arg)
    setattr(model, UNSLOTH_FLAG, True)
    info.update(parameter_counts(model))
    info["lora"] = asdict(spec)
    info["target_parameters"] = list(getattr(model.peft_config["default"], "target_parameters", None) or [])
    info["gradient_checkpointing"] = gc_arg
    info["max_seq_length"] = max_seq_length
    info["load_seconds"] = round(time.perf_counter() - t0, 2)
    return model, tokenizer, info
