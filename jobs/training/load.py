"""Load the base model and its LoRA for training: Unsloth on CUDA, transformers + PEFT elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import StepShape
from jobs.training.config import TrainConfig

log = structlog.get_logger("nightshift.train")


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    backend: str
    device: str
    info: dict[str, Any]


def resolve_backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    import importlib.util

    import torch

    return "unsloth" if torch.cuda.is_available() and importlib.util.find_spec("unsloth") else "hf"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return ensure_pad_token(AutoTokenizer.from_pretrained(str(model_path), local_files_only=True))


def ensure_pad_token(tok: Any) -> Any:
    """Padded batches and evaluation need a pad id; models without one pad with end-of-sequence."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_for_training(model_path: Path, cfg: TrainConfig, *, adapter: Path | None, shape: StepShape,
                      cache_dir: Path | None = None) -> Loaded:
    """Base model + LoRA: from `adapter` (the one in service, or a checkpoint) or a fresh one."""
    backend = resolve_backend(cfg)
    if backend == "unsloth":
        from jobs.training.unsloth_backend import LoraSpec, load_unsloth  # GPU-only stack, imported only here

        model, tok, info = load_unsloth(
            model_path, lora=LoraSpec.from_train_config(cfg), gradient_checkpointing=shape.gradient_checkpointing,
            max_seq_length=max(cfg.max_seq_length, shape.tokens_per_step if cfg.batching == "packed" else 0),
            parent_adapter=adapter, cache_dir=cache_dir)
        ensure_pad_token(tok)
        log.info("model_loaded", device=device_name(), **info)
        return Loaded(model, tok, "unsloth", "cuda", info)
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch.bfloat16 if cuda else torch.float32}
    quantized = cuda and cfg.load_in_4bit
    if quantized:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
        kwargs["device_map"] = {"": torch.cuda.current_device()}  # [distributed] each rank its own card
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=shape.gradient_checkpointing)
    elif shape.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if cuda and not quantized:
        model.to("cuda")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    else:
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules=cfg.target_modules, task_type="CAUSAL_LM",
        ))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    info = {"trainable_parameters": trainable, "total_parameters": total, "quantized_4bit": quantized,
            "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False))}
    log.info("model_loaded", backend="hf", device=device_name(), **info)
    return Loaded(model, load_tokenizer(model_path), "hf", "cuda" if cuda else "cpu", info)
