"""Resumable checkpoints: adapter + optimizer + position in the run's batch sequence.

Written to a temp dir, fsynced, then rotated in with renames, so a kill at any moment leaves
either the previous or the new checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from jobs.store.files import fsync_tree


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
