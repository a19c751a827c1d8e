"""What a loader hands the training loop, and the tokenizer as every loader reads it (apart from load.py
so that the in-memory MoE path, which load.py dispatches to, can return the same thing)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.contract import Method
from jobs.training.optim import OptimizerChoice


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    backend: str
    device: str
    info: dict[str, Any]
    method: Method = Method.qlora
    optim: OptimizerChoice | None = None  # None: torch AdamW (fused on CUDA)


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return ensure_pad_token(AutoTokenizer.from_pretrained(str(model_path), local_files_only=True))


def ensure_pad_token(tok: Any) -> Any:
    """Padded batches and evaluation need a pad id; models without one pad with end-of-sequence."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
