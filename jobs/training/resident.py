"""The base model kept in memory between the adapters of one night ([[adapters]], jobs/night/several).

Loading an 8B base takes seconds to minutes; the adapters of a night share it. Two ways, by the next adapter's
LoRA shape (rank, alpha, dropout, target modules, ... and the seed its fresh LoRA is drawn with; `LoraShape`):

- the same shape as the LoRA held: the whole PEFT model is kept, FP8-patched base included
  (jobs/training/fp8/enable.py runs once, at the first load), and the held LoRA's parameters are set IN PLACE
  to where the next adapter starts (`restart`): the fresh LoRA that get_peft_model drew at the first load under
  the same seed (kept, `init`), then the parent's weights where it continues one, exactly what a fresh load
  does after its own get_peft_model. Nothing of the last adapter stays: its gradients and any
  optimizer-in-backward hooks are dropped, the optimizer is built anew by the loop, and FP8 holds no state that
  depends on the LoRA (weight scales per output channel, activations scaled per token at each step).
  The adapter trains bit for bit as on a freshly loaded base (tests/night/test_adapters_resident.py).
- another shape: the LoRA is taken off with PEFT's `unload()` (its layers replaced by the base's own, nothing
  merged) and the next one put on; not with FP8, whose patched base is loaded again. Full fine-tuning always
  loads again.

With Unsloth, a held model that will not take the next LoRA (an exception) is let go and loaded again: the
night goes on as if nothing was held. Off unless a night of several adapters turns it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("nightshift.train")


@dataclass(frozen=True)
class LoraShape:
    """What two LoRAs must share for one to be set in place of the other: PEFT's LoraConfig fields that shape
    its layers or their forward, normalised (target lists sorted). Notation counts: "all-linear" and the list it
    expands to are two shapes, so a held LoRA answers to both (`Hold.shapes`): the one asked for and PEFT's
    config once it put it on (what a saved adapter's config says)."""

    fields: tuple[Any, ...]

    @classmethod
    def of_config(cls, c: Any) -> LoraShape:
        def norm(v: Any) -> Any:
            if isinstance(v, list | set | tuple):
                return tuple(sorted(str(x) for x in v)) or None
            if isinstance(v, dict):
                return tuple(sorted((str(k), norm(x)) for k, x in v.items()))
            return v
        names = ("r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "bias", "use_rslora",
                 "use_dora", "lora_bias", "init_lora_weights", "modules_to_save", "layers_to_transform",
                 "layers_pattern", "rank_pattern", "alpha_pattern", "exclude_modules", "fan_in_fan_out")
        return cls(tuple((n, norm(getattr(c, n, None))) for n in names))

    @classmethod
    def of_spec(cls, spec: Any) -> LoraShape:
        """Unsloth's LoraSpec (jobs/training/backends/unsloth_lora.py): Unsloth sets the rest the same each time."""
        return cls((("r", spec.r), ("alpha", spec.alpha), ("dropout", spec.dropout),
                    ("target_modules", tuple(sorted(spec.modules())))))


@dataclass
class Hold:
    """What a load leaves to hold: under which key, the LoRA's shape and seed, its fresh draw (`init`: PEFT's
    state-dict keys -> CPU copies) and, once FP8 patched the base, the load info's "fp8"."""

    key: tuple[Any, ...]
    shapes: frozenset[LoraShape]
    seed: int
    init: dict[str, Any]
    fp8: dict[str, Any] | None = None
    reused: bool = False  # this load took the held model (same shape)


@dataclass
class _Held:
    hold: Hold
    model: Any  # the PeftModel last built on the base
    tokenizer: Any = None  # what came with it (Unsloth's load returns one)


@dataclass
class Taken:
    """`same`: the held PeftModel, its LoRA to `restart` in place (its Hold says what it was drawn as and how FP8
    patched it); else the bare base, its LoRA taken off, for a LoRA of another shape."""

    model: Any
    tokenizer: Any
    same: bool
    hold: Hold


_state: dict[str, Any] = {"on": False, "held": None, "reused": 0}


def enable(on: bool = True) -> None:
    """A night of several adapters keeps the base between them; turning it off lets it go."""
    _state["on"], _state["held"] = on, None


def active() -> bool:
    return bool(_state["on"])


def take(key: tuple[Any, ...], shape_of: Callable[[Any], LoraShape], seed: int) -> Taken | None:
    """What is held under `key` for a LoRA of `shape_of(base held)` drawn with `seed`; None: load it (and the
    one held is let go). An FP8-patched base goes back only to a LoRA of its own shape."""
    held: _Held | None = _state["held"]
    _state["held"] = None
    if not _state["on"] or held is None or held.hold.key != key:
        return None
    same = shape_of(held.model.get_base_model()) in held.hold.shapes and seed == held.hold.seed
    if not same and held.hold.fp8 is not None:
        log.info("base_not_reused", why="another LoRA shape on an FP8-patched base: loaded again")
        del held
        release()  # its memory back to the card before the base is loaded again
        return None
    model = held.model if same else held.model.unload()  # unload: the LoRA layers replaced by the base's own
    _state["reused"] += 1
    log.info("base_reused", reused=_state["reused"], lora="restarted in place" if same else "unloaded, attached")
    return Taken(model, held.tokenizer, same, held.hold)


def keep(hold: Hold, model: Any, tokenizer: Any = None) -> None:
    """Hold the PEFT model just built (or restarted) on the base, for the next adapter of the night."""
    if _state["on"]:
        _state["held"] = _Held(hold, model, tokenizer)


def snapshot(model: Any) -> dict[str, Any]:
    """The LoRA as get_peft_model just drew it (CPU copies; an 8B's r16 on every projection: ~170 MB), kept
    while the base is held so that a later adapter starts from the very same draw."""
    from peft import get_peft_model_state_dict

    if not _state["on"]:
        return {}
    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def restart(model: Any, init: dict[str, Any], parent: Path | None) -> dict[str, Any]:
    """Set the held LoRA in place to where the next adapter starts: `init` (the fresh draw), then the parent's
    weights (as a fresh load: get_peft_model, then the parent loaded). Its gradients and the hooks an
    optimizer-in-backward left on its parameters go (a fresh LoRA has neither). Returns load-info keys."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    current = get_peft_model_state_dict(model)
    if set(init) != set(current) or any(tuple(init[k].shape) != tuple(current[k].shape) for k in current):
        raise ValueError("the held LoRA is not the one its fresh draw was kept for")
    res = set_peft_model_state_dict(model, init)
    missing = [k for k in getattr(res, "missing_keys", []) or [] if "lora_" in k]
    if missing:
        raise ValueError(f"the fresh LoRA did not land in {len(missing)} parameters, e.g. {missing[:3]}")
    info: dict[str, Any] = {}
    if parent is not None:
        info["parent_adapter"] = str(parent)
        info["parent_keys_loaded"] = load_adapter_weights(model, Path(parent))
    for p in model.parameters():
        p.grad = None
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)  # torch keeps them there (RemovableHandle's dict)
        if hooks:
            hooks.clear()
    return info


def load_adapter_weights(model: Any, adapter_dir: Path) -> int:
    """Load a saved adapter's LoRA weights into the model's (same-shaped) adapter; all keys must land."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    f = adapter_dir / "adapter_model.safetensors"
    state = load_file(str(f)) if f.exists() else _load_bin(adapter_dir / "adapter_model.bin")
    res = set_peft_model_state_dict(model, state, adapter_name="default")
    unexpected = list(getattr(res, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"parent adapter {adapter_dir} has {len(unexpected)} keys this model lacks, e.g. {unexpected[:3]}"
        )
    return len(state)


def _load_bin(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def reused() -> int:
    """How many loads this process skipped."""
    return int(_state["reused"])


def release() -> None:
    """Between adapters: what the last one left (its optimizer, activations) returned to the card."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
