"""PEFT beside Unsloth's dependencies: what a process must do before it imports PEFT."""

from __future__ import annotations

import sys

import structlog

log = structlog.get_logger("nightshift.train")


def hide_torchao_peft_refuses() -> bool:
    """PEFT refuses every LoRA on a 16-bit layer when the torchao installed is older than it supports (Unsloth
    accepts 0.13 and up, PEFT 0.21 wants 0.16): a process that uses no torchao and has not imported it yet
    stops seeing it. True when hidden."""
    try:
        from peft.import_utils import is_torchao_available
    except ImportError:
        return False
    try:
        is_torchao_available()
        return False
    except ImportError:
        if "torchao" in sys.modules:  # imported already (Unsloth): PEFT's own error stands
            return False
        sys.modules["torchao"] = None  # type: ignore[assignment]
        is_torchao_available.cache_clear()
        log.info("torchao_hidden", reason="older than PEFT supports; the transformers path does not use it")
        return True
