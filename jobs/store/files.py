"""Durable files: content hashes and fsync, shared by every step that writes or checks one.

A rename is only atomic for readers; surviving a power cut also needs the file's data
and the directory entry on disk, hence fsync of both before and after the rename.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


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
