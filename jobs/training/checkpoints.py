"""Resumable checkpoints: adapter + optimizer + position in the run's batch sequence.

Written to a temp dir with the sha256 of every file, fsynced, then rotated in with renames
(latest -> previous, temp -> latest), so a kill at any moment leaves at least one whole checkpoint.
Two are kept: a latest one that is damaged (a disk error, a truncated file) is skipped with a warning
and the run resumes from the previous one; with neither usable it restarts its training from the
adapter it started from (nothing is marked trained before publication, so nothing is trained twice).
The checkpoints of a run are private to the service user and removed when the run closes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from jobs.contract.crashpoints import declare, reached
from jobs.store.files import PRIVATE_DIR, PRIVATE_FILE, fsync_tree, make_dir, seal_tree, sha256_file
from jobs.training.loop_state import LoopState

log = structlog.get_logger("nightshift.train")
CHECKSUMS = "checksums.json"
WRITTEN = declare("train.checkpoint.written", "a checkpoint is whole and fsynced under its temporary name; "
                                              "the rotation has not begun")
ROTATED = declare("train.checkpoint.rotated", "the latest checkpoint was renamed to previous; the new one is "
                                              "not latest yet")
SAVED = declare("train.checkpoint.saved", "the new checkpoint was renamed to latest")


def read_state(p: Path) -> LoopState:
    """The loop's state in checkpoint `p` (raises OSError / ValidationError: see checkpoint_problem)."""
    return LoopState.model_validate_json((p / "state.json").read_bytes())


def checkpoint_problem(p: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None: it is whole)."""
    try:
        read_state(p)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the file"
        return f"state.json is not the loop's state: {where}: {first['msg']} ({e.error_count()} problem(s))"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    try:
        sums = json.loads((p / CHECKSUMS).read_text())
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(sums, dict) or "optimizer.pt" not in sums:
        return f"{CHECKSUMS} lists no optimizer state"
    for name, digest in sums.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        if sha256_file(f) != digest:
            return f"{name} does not match its sha256 (truncated or altered)"
    return None


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest whole checkpoint (latest, else previous), or None."""
    for name in ("latest", "previous"):
        p = ckpt_root / name
        if not p.exists():
            continue
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        log.warning("checkpoint_unusable", checkpoint=str(p), problem=problem,
                    then="the previous checkpoint" if name == "latest" else "the run's start")
    return None


def save_checkpoint(ckpt_root: Path, model: Any, optimizer: Any, scheduler: Any, state: LoopState) -> None:
    """Write to a temp dir, then rotate previous out, latest -> previous and temp -> latest (renames)."""
    import torch

    make_dir(ckpt_root.parent, PRIVATE_DIR)  # raw training state: the service user's only
    make_dir(ckpt_root, PRIVATE_DIR)
    for stale in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = ckpt_root / f".tmp-{os.getpid()}"
    model.save_pretrained(str(tmp))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    sums = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / CHECKSUMS).write_text(json.dumps(sums))
    (tmp / "state.json").write_text(state.model_dump_json())  # last: a checkpoint without it is never used
    seal_tree(tmp, dir_mode=PRIVATE_DIR, file_mode=PRIVATE_FILE)
    fsync_tree(tmp)
    reached(WRITTEN)
    latest, previous = ckpt_root / "latest", ckpt_root / "previous"
    if latest.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(latest, previous)
        reached(ROTATED)
    os.rename(tmp, latest)
    reached(SAVED)
