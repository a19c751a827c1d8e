"""The base model kept in memory between the adapters of one night ([[adapters]], jobs/night/several).

Loading an 8B base takes seconds to minutes; the adapters of a night share it. The LoRA of the adapter
just trained is taken off with PEFT's `unload()` (its layers replaced by the base's own, nothing merged:
the base weights are the ones loaded, checked in tests/night/test_adapters_resident.py) and the next
adapter's LoRA is put on the same base. Only where nothing but the LoRA touched the base: lora and qlora
without FP8 compute (full fine-tuning and FP8 reload the base each time). With Unsloth, a base that will
not take the next LoRA (an exception) is let go and loaded again: the night goes on as if nothing was held.
Off unless a night of several adapters turns it on: a night of one loads once anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("nightshift.train")


@dataclass
class _Held:
    key: tuple[Any, ...]
    model: Any  # the PeftModel last built on the base
    tokenizer: Any = None  # what came with it (Unsloth's load returns one)


_state: dict[str, Any] = {"on": False, "held": None, "reused": 0}


def enable(on: bool = True) -> None:
    """A night of several adapters keeps the base between them; turning it off lets it go."""
    _state["on"], _state["held"] = on, None


def take(key: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """(the base held under `key`, its last LoRA taken off; its tokenizer); None: load it (and the one held
    is let go)."""
    held: _Held | None = _state["held"]
    _state["held"] = None
    if not _state["on"] or held is None or held.key != key:
        return None
    base = held.model.unload()  # the LoRA layers replaced by the base's own; nothing merged
    _state["reused"] += 1
    log.info("base_reused", reused=_state["reused"])
    return base, held.tokenizer


def keep(key: tuple[Any, ...], model: Any, tokenizer: Any = None) -> None:
    """Hold the PEFT model just built on the base, for the next adapter of the night."""
    if _state["on"]:
        _state["held"] = _Held(key, model, tokenizer)


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
