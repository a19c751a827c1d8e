"""Unsloth's LoRA on a loaded base: the second half of a load (jobs/training/backends/unsloth.py), and all of
one where a night of several adapters holds the base from the adapter before (jobs/training/resident.py)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraSpec:
    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGETS))
    seed: int = 3407
    target_parameters: list[str] = field(default_factory=list)  # a parent's fused experts (PEFT's name)

    @classmethod
    def from_train_config(cls, cfg: Any) -> LoraSpec:
        """From jobs.training.loop.TrainConfig ([train] lora_rank, lora_alpha, lora_dropout, target_modules, seed)."""
        return cls(
            r=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout,
            target_modules=cfg.target_modules,
            seed=cfg.seed,
        )

    def modules(self) -> list[str]:
        """ "all-linear" means every projection of attention and MLP (experts included), not the router."""
        tm = self.target_modules
        return list(DEFAULT_TARGETS) if tm == "all-linear" else list(tm if isinstance(tm, list) else [tm])

    def names_on(self, model: Any) -> list[str]:
        """The module names to hand Unsloth for this LoRA on `model`. A parent that Unsloth's MoE path saved holds
        one regex over its attention modules plus `target_parameters` for the fused experts; handed back as a
        name, Unsloth matched nothing and refused GPT-OSS's second night ("No layers to finetune", RESULTS.md:
        2026-11-28, FP8 / NF4 / bf16 task accuracy (GPT-OSS)). The regex is read as PEFT reads it (re.fullmatch on
        the base's module names) and each fused expert weight named by its projections again."""
        tm = self.target_modules
        if not isinstance(tm, str) or tm == "all-linear":
            return self.modules()
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n and re.fullmatch(tm, n)}
        for p in self.target_parameters:
            leaf = p.rsplit(".", 1)[-1]  # gate_up_proj: gate_proj and up_proj reach it (moe/lora.py _wanted_fused)
            names |= ({f"{s}_proj" for s in leaf.removesuffix("_proj").split("_")} if leaf.endswith("_proj")
                      else {leaf})
        if not names:
            raise ValueError(f"the parent adapter's target_modules {tm!r} name no module of this base")
        return sorted(names)


def parameter_counts(model: Any) -> dict[str, Any]:
    """Trainable / total counts, and how many trainable ones sit in MoE experts (0 on dense models)."""
    trainable = total = experts = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if p.__class__.__name__ == "Params4bit":  # packed 2 weights per byte (uint8 storage)
            n = int(getattr(p, "quant_state", None).shape.numel()) if getattr(p, "quant_state", None) else n * 2
        total += n
        if p.requires_grad:
            trainable += n
            if ".experts." in name:
                experts += n
    return {
        "trainable_parameters": trainable,
        "total_parameters": total,
        "trainable_in_experts": experts,
        "trainable_percent": round(100.0 * trainable / max(1, total), 4),
    }


def attach_lora(model: Any, tokenizer: Any, *, lora: LoraSpec, parent_adapter: Path | str | None,
                gc_arg: bool | str, max_seq_length: int, info: dict[str, Any],
                t0: float) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info): the LoRA put on `model` (the parent's shape and weights when continuing)
    and the model made ready to train. `t0`: when the load began (info's load_seconds)."""
    from unsloth import FastLanguageModel

    from jobs.training.step import UNSLOTH_FLAG

    spec = spec_for(lora, parent_adapter)
    t3 = time.perf_counter()
    model = FastLanguageModel.get_peft_model(
        model,
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.names_on(model),
        bias="none",
        use_gradient_checkpointing=gc_arg,
        random_state=spec.seed,
        max_seq_length=max_seq_length,
    )
    from jobs.training import resident

    info["lora_init"] = resident.snapshot(model)  # the draw a held LoRA restarts from (popped by load.py)
    if parent_adapter is not None:
        info["parent_adapter"] = str(parent_adapter)
        info["parent_keys_loaded"] = resident.load_adapter_weights(model, Path(parent_adapter))
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


def spec_for(lora: LoraSpec, parent_adapter: Path | str | None) -> LoraSpec:
    """The parent's shape when continuing (its adapter_config.json), else the configured one."""
    if parent_adapter is None:
        return lora
    pcfg = json.loads((Path(parent_adapter) / "adapter_config.json").read_text())
    tm = pcfg.get("target_modules") or lora.modules()
    tm = sorted(tm) if isinstance(tm, list | set) else tm
    return LoraSpec(r=int(pcfg.get("r", lora.r)), alpha=int(pcfg.get("lora_alpha", lora.alpha)),
                    dropout=float(pcfg.get("lora_dropout", lora.dropout)), target_modules=tm, seed=lora.seed,
                    target_parameters=sorted(pcfg.get("target_parameters") or []))


def restart_lora(model: Any, tokenizer: Any, *, init: dict[str, Any], parent_adapter: Path | str | None,
                 gc_arg: bool | str, info: dict[str, Any], t0: float) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info): the held PEFT model of the same LoRA shape, its LoRA set in place to the fresh
    draw and the parent's weights (jobs/training/resident.py `restart`), made ready to train as attach_lora does;
    its FP8-patched base (if any) untouched."""
    from unsloth import FastLanguageModel

    from jobs.training import resident
    from jobs.training.step import UNSLOTH_FLAG

    info.update(resident.restart(model, init, Path(parent_adapter) if parent_adapter is not None else None))
    FastLanguageModel.for_training(model, use_gradient_checkpointing=gc_arg)
    setattr(model, UNSLOTH_FLAG, True)
    info.update(parameter_counts(model))
    info["gradient_checkpointing"] = gc_arg
    info["load_seconds"] = round(time.perf_counter() - t0, 2)
    return model, tokenizer, info
