"""The optimizer of a run, chosen from what memory allows.

LoRA trains a few million weights: torch's AdamW (its fused kernel on CUDA) costs nothing worth
counting. Full fine-tuning trains every weight, and on one card the optimizer is what decides
whether an 8B fits at all. Per trained weight of b bytes (bf16: 2) a step holds:

    weights b + gradients b + AdamW's two moments 2b (torch keeps them in the weights' dtype)
    bitsandbytes' 8-bit AdamW: the moments in 2 bytes instead of 2b
    the step in the backward pass: gradients never all exist (each weight is stepped, and its
    gradient dropped, as soon as it is ready: torchtune's "optimizer in backward")

    8B in bf16:  adamw 64 GB | adamw_8bit 48 GB | adamw in backward 48 GB | adamw_8bit in backward 32 GB

`auto` takes the first of these (fastest first) whose weights, gradients and states stay under
FIT_SHARE of the cap ([gpu] max_vram_gb, else the card's memory), leaving the rest to activations,
the CUDA context and the allocator. The step in backward has two costs, said where it is chosen: no
gradient clipping (the whole gradient never exists to measure its norm), and a step retried as two
halves after an out-of-memory becomes two optimizer steps.

bitsandbytes is imported inside functions only (GPU-only stack).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from jobs.contract import Method
from jobs.training.config import TrainConfig

FIT_SHARE = 0.7  # weights + gradients + optimizer states may take this share of the cap
Kind = Literal["adamw", "adamw_8bit"]
ORDER: tuple[tuple[Kind, bool], ...] = (  # fastest first: (optimizer, step in backward)
    ("adamw", False), ("adamw_8bit", False), ("adamw", True), ("adamw_8bit", True))


@dataclass(frozen=True)
class OptimizerChoice:
    kind: Kind
    in_backward: bool
    reason: str
    static_gb: float | None = None  # predicted weights + gradients + states (full fine-tuning on CUDA)

    def as_info(self) -> dict[str, Any]:
        return {"optimizer": self.kind, "optimizer_in_backward": self.in_backward, "optimizer_reason": self.reason,
                "optimizer_static_gb": self.static_gb}


def static_bytes(trainable: int, param_bytes: int, kind: Kind, in_backward: bool) -> int:
    """Weights, gradients (unless stepped in backward) and AdamW's moments, in bytes."""
    states = 2 * trainable if kind == "adamw_8bit" else 2 * param_bytes * trainable
    grads = 0 if in_backward else param_bytes * trainable
    return param_bytes * trainable + grads + states


def have_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def choose_optimizer(cfg: TrainConfig, *, trainable: int, param_bytes: int, cuda: bool, cap_gb: float | None,
                     bnb: bool) -> OptimizerChoice:
    """What `[train] optimizer` and `optimizer_in_backward` resolve to. Explicit values win (an
    impossible one is a clear error); `auto` follows the module's rule."""
    if cfg.optimizer == "adamw_8bit" and not (cuda and bnb):
        raise ValueError('[train] optimizer = "adamw_8bit" needs CUDA and bitsandbytes (the `gpu` extra)')
    kinds: list[Kind] = ["adamw", "adamw_8bit"] if cfg.optimizer == "auto" else [cfg.optimizer]
    steps = [False, True] if cfg.optimizer_in_backward == "auto" else [bool(cfg.optimizer_in_backward)]
    if not (cuda and bnb):
        kinds = [k for k in kinds if k != "adamw_8bit"]
    explicit = len(kinds) == 1 and len(steps) == 1
    if cfg.method is not Method.full or not cuda or cap_gb is None:
        why = ("from config" if explicit else "LoRA: few trainable weights" if cfg.method is not Method.full
               else "on the CPU nothing to fit")
        return OptimizerChoice(kinds[0], steps[0], why)
    options = [o for o in ORDER if o[0] in kinds and o[1] in steps]
    limit = FIT_SHARE * cap_gb * 1e9
    for kind, step in options:
        need = static_bytes(trainable, param_bytes, kind, step)
        if need <= limit:
            return OptimizerChoice(kind, step, f"weights + gradients + states {need / 1e9:.1f} GB fit in "
                                   f"{FIT_SHARE:.0%} of {cap_gb:g} GB", round(need / 1e9, 2))
    kind, step = min(options, key=lambda o: static_bytes(trainable, param_bytes, *o))
    need = static_bytes(trainable, param_bytes, kind, step)
    return OptimizerChoice(kind, step, f"the smallest option: {need / 1e9:.1f} GB, more than {FIT_SHARE:.0%} of "
                           f"{cap_gb:g} GB (calibrate says whether any step fits)", round(need / 1e9, 2))


def choose_for_model(model: Any, cfg: TrainConfig, *, device: str, max_vram_gb: float | None) -> OptimizerChoice:
    """choose_optimizer for a loaded model: its trainable weights, their dtype, the cap."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    size = trainable[0].element_size() if trainable else 2
    cuda = device == "cuda"
    cap = max_vram_gb
    if cuda and cap is None:
        import torch

        cap = torch.cuda.get_device_properties(0).total_memory / 1e9
    return choose_optimizer(cfg, trainable=n, param_bytes=size, cuda=cuda, cap_gb=cap, bnb=have_bitsandbytes())


def build_optimizer(model: Any, cfg: TrainConfig, choice: OptimizerChoice | None, *, device: str) -> Any:
    """The optimizer over the model's trainable weights (None: torch AdamW, fused on CUDA)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    kind = choice.kind if choice else "adamw"
    if choice is not None and choice.in_backward:
        return in_backward(named, kind=kind, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, device=device)
    return _make(kind, [p for _, p in named], lr=cfg.learning_rate, weight_decay=cfg.weight_decay, device=device)



def _make(kind: Kind, params: list[Any], *, lr: float, weight_decay: float, device: str) -> Any:
    if kind == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device == "cuda")


_IMPL: list[type] = []


def in_backward(named: Iterable[tuple[str, Any]], *, kind: Kind, lr: float, weight_decay: float, device: str) -> Any:
    """An optimizer that steps each weight in its post-accumulate-grad hook and drops its gradient,
    so the model's gradients never all exist at once. To the loop it is an optimizer: `step` and
    `zero_grad` do nothing (the backward pass did both), the learning rate lives in `param_groups`
    (the scheduler sets it there; each hook reads it), `state_dict` holds every weight's own state.
    A torch Optimizer subclass, defined at first use (torch's LR schedulers insist on one; this
    module imports without torch)."""
    if not _IMPL:
        _IMPL.append(_define())
    return _IMPL[0](named, kind=kind, lr=lr, weight_decay=weight_decay, device=device)


def _define() -> type:
    import torch

    class InBackward(torch.optim.Optimizer):
        in_backward = True

        def __init__(self, named: Iterable[tuple[str, Any]], *, kind: Kind, lr: float, weight_decay: float,
                     device: str) -> None:
            named = list(named)
            super().__init__([p for _, p in named], {"lr": lr, "weight_decay": weight_decay})
            self.kind = kind
            self.inner = {n: _make(kind, [p], lr=lr, weight_decay=weight_decay, device=device) for n, p in named}
            self._by_id = {id(p): self.inner[n] for n, p in named}
            self._hooks = [p.register_post_accumulate_grad_hook(self._step_one) for _, p in named]

        def _step_one(self, p: Any) -> None:
            opt = self._by_id[id(p)]
            lr = self.param_groups[0]["lr"]
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            p.grad = None

        def step(self, closure: Any = None) -> None:  # the backward pass stepped every weight
            return None

        def zero_grad(self, set_to_none: bool = True) -> None:  # and dropped every gradient
            return None

        def state_dict(self) -> dict[str, Any]:
            return {"lr_groups": super().state_dict(), "inner": {n: o.state_dict() for n, o in self.inner.items()}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            super().load_state_dict(state["lr_groups"])
            missing = set(self.inner) - set(state["inner"])
            if missing:
                raise ValueError(f"the checkpoint's optimizer lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
            for n, o in self.inner.items():
                o.load_state_dict(state["inner"][n])

        def remove_hooks(self) -> None:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    return InBackward
