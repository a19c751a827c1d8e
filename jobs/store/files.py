"""Durable files: content hashes and fsync, shared by every step that writes or checks one.

A rename is only atomic for readers; surviving a power cut also needs the file's data
and the directory entry on disk, hence fsync of both before and after the rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from jobs.contract.crashpoints import declare, reached

PRIVATE_JSON_REPLACED = declare("files.private_json_replaced",
                                "a private JSON state file (scores, before-scores) is replaced")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file below root, then root itself."""
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(Path(root))


# ---- damaged state and permissions -----------------------------------------------------------------
# Modes are set explicitly (chmod), so they hold whatever umask the process inherited: what the
# inference server reads is group-readable, raw user data and training state are private.
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # ledger, quarantine, checkpoints, locks
SHARED_DIR, SHARED_FILE = 0o750, 0o440  # published versions: the inference server's group reads them


class StatePermission(PermissionError):
    """This user may not read (or write) the state directory: a permission, never damage. The message names
    the path and what to do; the state itself is left as it is."""


def permission_problem(path: Path, e: OSError | None = None, *, write: bool = True) -> StatePermission:
    why = f" ({e.strerror})" if e is not None and e.strerror else ""
    return StatePermission(f"{path}: permission denied{why}: this user may not {'write' if write else 'read'} the "
                           "state directory (it belongs to another user, or is read-only); its files are left as "
                           "they are: run as the service's user, or give this one access")


def writable(directory: Path) -> bool:
    """A real attempt (not os.access, which root always passes): can a file be created here?"""
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".nightshift-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


class DamagedState(RuntimeError):
    """The state directory is inconsistent or damaged: refused (never taken for a fresh start).
    The message says what is wrong and how to repair it; `nightshift doctor` lists everything."""


def chmod_quietly(path: Path, mode: int) -> None:
    """Set a mode where we may (the owner); a file someone else owns keeps its own."""
    with contextlib.suppress(PermissionError, FileNotFoundError):
        os.chmod(path, mode)


def make_dir(path: Path, mode: int) -> Path:
    """mkdir -p, then the directory itself gets exactly `mode` (parents created on the way keep umask's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if (path.stat().st_mode & 0o777) != mode:
        chmod_quietly(path, mode)
    return path


def seal_tree(root: Path, *, dir_mode: int = SHARED_DIR, file_mode: int = SHARED_FILE) -> None:
    """A published version: directories `dir_mode`, files `file_mode` (read-only: write-once)."""
    for p in Path(root).rglob("*"):
        if p.is_symlink():
            continue
        os.chmod(p, dir_mode if p.is_dir() else file_mode)
    os.chmod(root, dir_mode)


def write_private_json(path: Path, obj: Any) -> None:
    """`path` replaced atomically by `obj` as JSON, readable by the owner only; its directory (and the one
    above) made private too. State the next attempt or night reads back, never half written."""
    path = Path(path)
    make_dir(path.parent.parent, PRIVATE_DIR)
    make_dir(path.parent, PRIVATE_DIR)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj))
        os.chmod(tmp, PRIVATE_FILE)
        os.replace(tmp, path)
        reached(PRIVATE_JSON_REPLACED)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
