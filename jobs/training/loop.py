"""Train: one readable routine (setup / train / checkpoint / save), no trainer hierarchy.

Runs only in the night's child process. It continues from the adapter in service,
checkpoints every `checkpoint_every_seconds` (adapter + optimizer + position in the
batch sequence) so a killed run resumes where it stopped without training a sample
twice, and stops early enough to save before the deadline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from jobs.data.batching import Batch, TokenizedSample, padded_batches
from jobs.data.render import OverlongPolicy
from jobs.store.files import fsync_tree

log = structlog.get_logger("nightshift.train")


class TrainConfig(BaseModel):
    """[train]"""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["auto", "hf", "unsloth"] = "auto"  # auto: unsloth where CUDA and unsloth exist
    load_in_4bit: bool = True  # QLoRA base where CUDA exists; the CPU path trains plain LoRA
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    epochs: int = Field(1, ge=1)
    batching: Literal["packed", "padded"] = Field(
        "packed", description="packed: samples concatenated into one row per step (positions reset, no attention "
        "across samples); padded: rows padded to the longest sample")
    tokens_per_step: int | Literal["auto"] = Field(
        "auto", description="packed: real tokens per step; auto: what `nightshift calibrate` measured fits "
        "under [gpu] max_vram_gb, else max_tokens_per_batch")
    batch_size: int = Field(8, ge=1, description="padded: samples per step at most")
    max_tokens_per_batch: int = Field(16384, ge=16, description="padded tokens per step at most")
    max_seq_length: int = Field(2048, ge=16)
    overlong: OverlongPolicy = "reject"
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations to save memory; auto: calibrate's choice, else on")
    checkpoint_every_seconds: float = Field(600.0, gt=0)
    seed: int = 0


@dataclass
class TrainResult:
    trained_ids: list[int]  # consumed at least once (in order)
    tokens: int  # real (non-padding) tokens processed, all epochs
    seconds: float
    steps: int
    mean_loss: float | None
    stopped: str | None  # None: finished; "deadline" or "signal"
    resumed_from_step: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


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

    tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@dataclass(frozen=True)
class StepShape:
    """How big a step is and whether activations are recomputed: chosen once per run."""

    tokens_per_step: int
    gradient_checkpointing: bool
    basis: str


def resolve_step(cfg: TrainConfig, calibrated: dict[str, Any] | None) -> StepShape:
    """Config values win; "auto" takes what calibrate measured under the VRAM cap, else safe defaults."""
    cal = calibrated or {}
    tokens = cfg.tokens_per_step
    basis = "config"
    if tokens == "auto":
        tokens, basis = (int(cal["tokens_per_step"]), "calibrated") if cal.get("tokens_per_step") else (
            cfg.max_tokens_per_batch, "max_tokens_per_batch (not calibrated)")
    gc = cfg.gradient_checkpointing
    if gc == "auto":
        gc = bool(cal["gradient_checkpointing"]) if "gradient_checkpointing" in cal else True
    return StepShape(max(int(tokens), cfg.max_seq_length), bool(gc), basis)


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
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
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
        kwargs["device_map"] = {"": 0}
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
    info = {"trainable_parameters": trainable, "total_parameters": total, "quantized_4bit": quantized}
    log.info("model_loaded", backend="hf", device=device_name(), **info)
    return Loaded(model, load_tokenizer(model_path), "hf", "cuda" if cuda else "cpu", info)


def plan_batches(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int,
                 tokens_per_step: int) -> list[Batch]:
    """The whole run's batch sequence, deterministic from (samples, seed, step shape): a resume replays it."""
    import random

    from jobs.training.packing import packed_batches

    out: list[Batch] = []
    for epoch in range(cfg.epochs):
        order = list(samples)
        if epoch:  # first epoch in plan order (oldest first); later epochs shuffled
            random.Random(cfg.seed + epoch).shuffle(order)
        if cfg.batching == "packed":
            out.extend(packed_batches(order, tokens_per_step=tokens_per_step))
        else:
            out.extend(padded_batches(order, batch_size=cfg.batch_size,
                                      max_tokens_per_batch=cfg.max_tokens_per_batch, pad_id=pad_id))
    return out


# ---- checkpoints --------------------------------------------------------------------------------

def latest_checkpoint(ckpt_root: Path) -> Path | None:
    for name in ("latest", "previous"):
        p = ckpt_root / name
        if (p / "state.json").exists():
            return p
    return None


def save_checkpoint(ckpt_root: Path, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any]) -> None:
    """Write to a temp dir, then rotate latest -> previous and temp -> latest (each a rename)."""
    import torch

    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    fsync_tree(tmp)
    latest, previous = ckpt_root / "latest", ckpt_root / "previous"
    shutil.rmtree(previous, ignore_errors=True)
    if latest.exists():
        os.rename(latest, previous)
    os.rename(tmp, latest)
    shutil.rmtree(previous, ignore_errors=True)


# ---- the loop -----------------------------------------------------------------------------------

def train(
    loaded: Loaded, samples: Sequence[TokenizedSample], cfg: TrainConfig, *, ckpt_root: Path, deadline: float,
    stop: threading.Event, clock: Callable[[], float] = time.time,
    on_progress: Callable[[dict[str, Any]], None] = lambda _: None, resume: Path | None = None,
    save_seconds: float = 5.0, shape: StepShape | None = None,
    on_event: Callable[[dict[str, Any]], None] = lambda _: None,
) -> TrainResult:
    import torch

    from jobs.training.step import train_step

    model, device = loaded.model, loaded.device
    shape = shape or resolve_step(cfg, None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=device == "cuda")
    warm = max(1, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    state = {"next_batch": 0, "steps": 0, "tokens": 0, "seconds": 0.0, "loss_sum": 0.0, "loss_n": 0,
             "halved": False, "tokens_per_step": shape.tokens_per_step}

    def step_event(ev: dict[str, Any]) -> None:
        if ev.get("event") == "oom_split":  # from now on every step runs as two halves (also after a resume)
            state["halved"] = True
            log.warning("cuda_out_of_memory_step_halved", **{k: v for k, v in ev.items() if k != "event"})
        on_event(ev)

    if resume is not None:
        state = json.loads((resume / "state.json").read_text())
        opt = torch.load(resume / "optimizer.pt", map_location=device, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        # the batch sequence the checkpoint counted in, even if calibrate changed the step shape since
        shape = dataclasses.replace(shape, tokens_per_step=int(state.get("tokens_per_step", shape.tokens_per_step)))
    batches = plan_batches(samples, cfg, loaded.tokenizer.pad_token_id, shape.tokens_per_step)
    if resume is not None:
        log.info("resumed_from_checkpoint", checkpoint=str(resume), next_batch=state["next_batch"],
                 of=len(batches))
    resumed_from = int(state["next_batch"])
    model.train()
    started = clock()
    seconds_before = float(state["seconds"])
    last_ckpt = clock()
    step_ema: float | None = None
    stopped: str | None = None
    last_progress = 0.0
    total_tokens = sum(b.real_tokens for b in batches)
    for i in range(resumed_from, len(batches)):
        now = clock()
        if stop.is_set():
            stopped = "signal"
            break
        if step_ema is not None and now + 1.5 * step_ema + save_seconds > deadline:
            stopped = "deadline"
            break
        st = train_step(model, batches[i], optimizer, device=device, scheduler=scheduler, params=params,
                        on_event=step_event, halve=bool(state.get("halved")))
        loss, dt = st.loss, st.seconds
        step_ema = dt if step_ema is None else 0.8 * step_ema + 0.2 * dt
        state["next_batch"] = i + 1
        state["steps"] += 1
        state["tokens"] += batches[i].real_tokens
        state["loss_sum"] += loss
        state["loss_n"] += 1
        state["seconds"] = seconds_before + (clock() - started)
        if clock() - last_ckpt >= cfg.checkpoint_every_seconds and i + 1 < len(batches):
            save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
            last_ckpt = clock()
        if clock() - last_progress >= 1.0 or i + 1 == len(batches):
            last_progress = clock()
            tps = state["tokens"] / state["seconds"] if state["seconds"] > 0 else 0.0
            remaining = total_tokens - sum(b.real_tokens for b in batches[: i + 1])
            on_progress({"fraction": (i + 1) / len(batches), "tokens": state["tokens"], "steps": state["steps"],
                         "samples": len(_consumed(batches, i + 1)), "tokens_per_second": tps,
                         "eta": clock() + remaining / tps if tps > 0 else None, "loss": loss})
    if stopped == "signal":
        save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
        log.info("checkpoint_saved_on_stop", next_batch=state["next_batch"], of=len(batches))
    consumed = _consumed(batches, int(state["next_batch"]))
    return TrainResult(
        trained_ids=consumed, tokens=int(state["tokens"]), seconds=float(state["seconds"]),
        steps=int(state["steps"]), mean_loss=state["loss_sum"] / state["loss_n"] if state["loss_n"] else None,
        stopped=stopped, resumed_from_step=resumed_from,
        detail={"batches": len(batches), "batches_done": int(state["next_batch"]), "halved": state["halved"],
                "tokens_per_step": shape.tokens_per_step, "gradient_checkpointing": shape.gradient_checkpointing,
                "step_shape_basis": shape.basis, "batching": cfg.batching},
    )


def _consumed(batches: Sequence[Batch], upto: int) -> list[int]:
    seen: dict[int, None] = {}
    for b in batches[:upto]:
        for sid in b.sample_ids:
            seen.setdefault(sid, None)
    return list(seen)
