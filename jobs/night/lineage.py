"""Which method a version was trained with, and whether tonight's `[train] method` may continue it.

A night continues the version in service: a LoRA adapter (qlora, lora) or a whole model (full).
Continuing one as another method is refused before anything is loaded: a LoRA adapter is no
starting point for full fine-tuning and a full model is no adapter. Between qlora and lora the
adapter's format is the same but its weights were fitted to another base precision, so that is
refused too unless `[train] allow_method_change = true` says to go on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jobs.contract import Method
from jobs.store.files import PRIVATE_DIR, PRIVATE_FILE, make_dir
from jobs.training.config import TrainConfig

MARKER = "method.json"  # in a run's checkpoint directory: the method its checkpoints were trained with


class MethodChangeError(ValueError):
    """Tonight's method cannot continue what is in service (or the run's checkpoint)."""


def method_of(manifest: dict[str, Any]) -> Method:
    """A version's method, from its manifest; versions from before methods existed were LoRA adapters
    trained as the default method (qlora)."""
    found = manifest.get("method") or ((manifest.get("config") or {}).get("train") or {}).get("method")
    return Method(found) if found else Method.qlora


def check_continuation(cfg: TrainConfig, name: str, trained_as: Method, *, cuda: bool = True) -> None:
    """Raise MethodChangeError with what to do when `cfg.method` cannot continue version `name`. `cuda`: where
    there is none, qlora trains as lora (older CPU versions were labelled qlora: the same base precision)."""
    want, trained_as = cfg.method.on(cuda), trained_as.on(cuda)
    if trained_as is want or (trained_as.is_adapter and want.is_adapter and cfg.allow_method_change):
        return
    what = "a LoRA adapter" if trained_as.is_adapter else "a whole model (full fine-tuning)"
    head = (f'[train] method = "{want.value}", but the version in service {name} was trained as '
            f'"{trained_as.value}" ({what}); a night continues the version in service, ')
    if trained_as.is_adapter and want.is_adapter:
        raise MethodChangeError(
            head + f'and its LoRA weights were fitted to the base as "{trained_as.value}" loads it '
            f'({"4-bit" if trained_as is Method.qlora else "16-bit"} on CUDA). Set method = "{trained_as.value}" '
            "again, or set [train] allow_method_change = true to continue the adapter on the other base")
    raise MethodChangeError(
        head + f'which "{want.value}" cannot do. Set method = "{trained_as.value}" again, or start a new lineage '
        "with another state_dir")


def check_checkpoint(ckpt_root: Path, method: Method, resuming: bool) -> None:
    """A resumed run must train on as the method its checkpoint was written by; record it otherwise."""
    marker = ckpt_root / MARKER
    if resuming and marker.is_file():
        trained_as = Method(json.loads(marker.read_text())["method"])
        if trained_as is not method:
            raise MethodChangeError(
                f'[train] method = "{method.value}", but this night\'s run checkpointed as "{trained_as.value}" '
                f'and resumes from that checkpoint: set method = "{trained_as.value}" again until the night ends')
        return
    make_dir(ckpt_root.parent, PRIVATE_DIR)  # raw training state: the service user's only
    make_dir(ckpt_root, PRIVATE_DIR)
    marker.write_text(json.dumps({"method": method.value}))
    os.chmod(marker, PRIVATE_FILE)


def check_parent(ledger: Any, cfg: TrainConfig, parent: int | None, *, cuda: bool = True) -> None:
    """The version a night continues (from the ledger) was trained with a method `cfg` can continue."""
    row = ledger.version(parent) if parent is not None else None
    if row is not None:
        check_continuation(cfg, row["name"], method_of(json.loads(row["manifest"] or "{}")), cuda=cuda)
