"""Load the model to train, by `[train] method`: Unsloth on CUDA, transformers (+ PEFT) elsewhere.

qlora: a 4-bit base (CUDA) and a LoRA on it; lora: the base in 16-bit (bf16 on CUDA, fp32 on the
CPU) and a LoRA; full: every weight of the model in service (or the base, the first night) trained.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import Method, StepShape
from jobs.training import resident
from jobs.training.backends.peft_env import hide_torchao_peft_refuses
from jobs.training.config import TrainConfig
from jobs.training.loaded import Loaded, ensure_pad_token, load_tokenizer
from jobs.training.moe import lora as moe

log = structlog.get_logger("nightshift.train")


def resolve_backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    import importlib.util

    import torch

    return "unsloth" if torch.cuda.is_available() and importlib.util.find_spec("unsloth") else "hf"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"




def check_start(path: Path, method: Method) -> None:
    """What a night continues from must be what its method trains: a LoRA adapter, or a whole model."""
    is_adapter = (path / "adapter_config.json").is_file()
    if method.is_adapter and not is_adapter:
        raise ValueError(f'[train] method = "{method.value}" continues a LoRA adapter, but {path} is not one '
                         "(no adapter_config.json): it was trained with another method")
    if not method.is_adapter and (is_adapter or not (path / "config.json").is_file()):
        raise ValueError(f'[train] method = "full" continues a whole model, but {path} is '
                         + ("a LoRA adapter" if is_adapter else "not a model directory (no config.json)"))


def load_for_training(model_path: Path, cfg: TrainConfig, *, adapter: Path | None, shape: StepShape,
                      cache_dir: Path | None = None, max_vram_gb: float | None = None) -> Loaded:
    """The model to train and its optimizer's choice. `adapter`: what the night continues from (the
    version in service, or a checkpoint): a LoRA adapter for qlora/lora, a whole model for full;
    None: a fresh LoRA on the base, or the base itself."""
    import torch

    from jobs.training.moe import load as moe_path
    from jobs.training.optim import choose_for_model

    if adapter is not None:
        check_start(Path(adapter), cfg.method)
    hold = None
    if moe_path.in_memory_arch(model_path):  # issue 15: weights built in GPU memory each night (120B > disk)
        loaded = moe_path.load_in_memory(model_path, cfg, adapter=adapter,
                                         gradient_checkpointing=shape.gradient_checkpointing)
    elif resolve_backend(cfg) == "unsloth":
        loaded, hold = _load_unsloth(model_path, cfg, adapter, shape, cache_dir)
    else:
        loaded, hold = _load_hf(model_path, cfg, adapter, shape)
    if shape.compute == "fp8":  # issue 16: the frozen base on FP8 tensor cores (never fails the load)
        if hold is not None and hold.reused and hold.fp8 is not None:  # the held base: patched at its first load
            loaded.info["fp8"] = {**hold.fp8, "reused_base": True}
        else:
            from jobs.training.fp8.enable import enable_for_run

            loaded.info["fp8"] = enable_for_run(loaded.model, loaded.tokenizer, cfg,
                                                unsloth=loaded.backend == "unsloth", device=loaded.device,
                                                cap_gb=max_vram_gb)
        if hold is not None:
            hold.fp8 = {k: v for k, v in loaded.info["fp8"].items() if k != "reused_base"}
    if hold is not None:  # [[adapters]]: held for the night's next adapter (jobs/training/resident.py)
        hold.reused = False
        resident.keep(hold, loaded.model, loaded.tokenizer if loaded.backend == "unsloth" else None)
    torch.manual_seed(cfg.seed)  # training draws from the seed, however the model came to be (loaded or held)
    loaded.optim = choose_for_model(loaded.model, cfg, device=loaded.device, max_vram_gb=max_vram_gb)
    loaded.info.update(method=loaded.method.value, **loaded.optim.as_info())
    log.info("model_loaded", **{"backend": loaded.backend, "device": device_name(), **loaded.info})
    return loaded


def _load_unsloth(model_path: Path, cfg: TrainConfig, adapter: Path | None, shape: StepShape,
                  cache_dir: Path | None) -> tuple[Loaded, resident.Hold | None]:
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth  # GPU-only stack, imported only here
    from jobs.training.backends.unsloth_lora import attach_lora, restart_lora, spec_for

    lora, gc = LoraSpec.from_train_config(cfg), shape.gradient_checkpointing
    max_seq = max(cfg.max_seq_length, shape.tokens_per_step if cfg.batching == "packed" else 0)
    gc_arg = "unsloth" if gc is True else gc
    # [[adapters]]: the model the night's previous adapter trained on (jobs/training/resident.py)
    key = ("unsloth", str(model_path), cfg.method.value, gc, max_seq, shape.compute)
    keeps = cfg.method is not Method.full
    spec = spec_for(lora, adapter)
    taken = resident.take(key, lambda _base: resident.LoraShape.of_spec(spec), spec.seed) if keeps else None
    loaded = None
    if taken is not None:
        t0 = time.perf_counter()
        try:
            if taken.same:  # the held LoRA restarted in place: no new LoRA, FP8's patch kept
                loaded = restart_lora(taken.model, taken.tokenizer, init=taken.hold.init, parent_adapter=adapter,
                                      gc_arg=gc_arg, info={"backend": "unsloth"}, t0=t0)
            else:
                loaded = attach_lora(taken.model, taken.tokenizer, lora=lora, parent_adapter=adapter,
                                     max_seq_length=max_seq, gc_arg=gc_arg, info={"backend": "unsloth"}, t0=t0)
            loaded[2]["base_reused"] = True
        except Exception as e:  # the held base is let go: loaded again below, the night goes on
            log.warning("base_reuse_failed", error=f"{type(e).__name__}: {e}"[:300])
            taken = None
            resident.release()
    if loaded is None:
        loaded = load_unsloth(model_path, lora=lora, gradient_checkpointing=gc, max_seq_length=max_seq,
                              parent_adapter=adapter, cache_dir=cache_dir, method=cfg.method.value)
    model, tok, info = loaded
    info.setdefault("base_reused", False)
    hold = None
    if keeps:
        init = taken.hold.init if taken is not None and taken.same else info.pop("lora_init", {})
        hold = resident.Hold(key, frozenset({resident.LoraShape.of_spec(spec)}), spec.seed, init,
                             fp8=taken.hold.fp8 if taken is not None and taken.same else None,
                             reused=taken is not None and taken.same)
    info.pop("lora_init", None)
    ensure_pad_token(tok)
    return Loaded(model, tok, "unsloth", "cuda", info, cfg.method), hold


def _lora_config(model: Any, cfg: TrainConfig, adapter: Path | None) -> Any:
    """The LoRA to put on `model`: the parent's shape when continuing one, else the configured one."""
    from peft import LoraConfig

    if adapter is not None:
        c = LoraConfig.from_pretrained(str(adapter))
        c.inference_mode = False  # trainable (saved adapters say True)
        return c
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, task_type="CAUSAL_LM",
                      **moe.lora_targets(model, cfg.target_modules))  # issue 15: MoE experts via target_parameters


def _load_hf(model_path: Path, cfg: TrainConfig, adapter: Path | None,
             shape: StepShape) -> tuple[Loaded, resident.Hold | None]:
    import torch

    hide_torchao_peft_refuses()
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    cuda = torch.cuda.is_available()
    full = cfg.method is Method.full
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch.bfloat16 if cuda else torch.float32}
    quantized = cuda and cfg.quantized_base
    if quantized:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
        kwargs["device_map"] = {"": torch.cuda.current_device()}  # [distributed] each rank its own card
    # [[adapters]]: the model the night's previous adapter trained on (jobs/training/resident.py)
    key = ("hf", str(model_path), quantized, cuda, shape.gradient_checkpointing, shape.compute)
    taken = None if full else resident.take(
        key, lambda base: resident.LoraShape.of_config(_lora_config(base, cfg, adapter)), cfg.seed)
    model = None if taken is None else taken.model
    info: dict[str, Any] = {}
    if model is None:
        # full fine-tuning continues the model in service (or a checkpoint): it is the whole model
        model = AutoModelForCausalLM.from_pretrained(str(adapter if full and adapter else model_path), **kwargs)
        moe.adapt_base(model)  # issue 15: GPT-OSS-like bases keep packed samples apart (sinks, windows)
        if quantized:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=shape.gradient_checkpointing)
        elif shape.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not full:
                model.enable_input_require_grads()
        if cuda and not quantized:
            model.to("cuda")
    hold = None
    if full:
        model.requires_grad_(True)
    elif taken is not None and taken.same:  # the held LoRA restarted in place (resident.restart)
        info.update(resident.restart(model, taken.hold.init, adapter))
        hold = taken.hold
        hold.reused = True
    else:  # get_peft_model under the seed (the draw a held LoRA restarts from), then the parent's weights
        lcfg = _lora_config(model, cfg, adapter)
        lshape = resident.LoraShape.of_config(lcfg)  # as asked for (get_peft_model may rewrite its config)
        torch.manual_seed(cfg.seed)
        model = get_peft_model(model, lcfg)
        put_on = resident.LoraShape.of_config(model.peft_config["default"])
        hold = resident.Hold(key, frozenset({lshape, put_on}), cfg.seed, resident.snapshot(model))
        if adapter is not None:
            info["parent_keys_loaded"] = resident.load_adapter_weights(model, Path(adapter))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    info.update({"trainable_parameters": trainable, "total_parameters": total, "quantized_4bit": quantized,
                 "trainable_in_experts": moe.trainable_in_experts(model),
                 "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                 "base_reused": taken is not None})
    if full and adapter is not None:
        info["continued_from"] = str(adapter)
    return Loaded(model, load_tokenizer(model_path), "hf", "cuda" if cuda else "cpu", info,
                  cfg.method.on(cuda)), hold
