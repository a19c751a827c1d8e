"""The adapter registry on disk: immutable versioned directories and an atomic `current`.

Nothing is half-published: a version is written under adapters/.tmp-*, every file and
the directory are fsynced, then it is renamed to adapters/<name>-vNNNN. `current` is a
relative symlink replaced with rename(2). Names are never reused (inference servers
cache adapters by name). The manifest records every file's sha256, checked before a
version is promoted or sent to an inference server.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jobs.contract import parse_version_name, version_name
from jobs.contract.crashpoints import declare, reached
from jobs.store.files import SHARED_DIR, fsync_dir, fsync_tree, make_dir, seal_tree, sha256_file
from jobs.store.paths import StatePaths

VERSION_WRITTEN = declare("registry.version_written", "a version's files are sealed and fsynced under .tmp-*")
VERSION_RENAMED = declare("registry.version_renamed", "the version directory has its final name, not yet recorded")
CURRENT_SWAPPED = declare("registry.current_swapped", "`current` points at the new version (rename + fsync)")

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"


class IntegrityError(RuntimeError):
    pass


def parse_version(dirname: str) -> int | None:
    parsed = parse_version_name(dirname)
    return parsed[1] if parsed else None


class Registry:
    def __init__(self, state_dir: Path, *, create: bool = True) -> None:
        """`create=False`: only read (`nightshift plan`): nothing is made."""
        self.state_dir = Path(state_dir)
        self.adapters = StatePaths(self.state_dir).adapters
        self.current_link = StatePaths(self.state_dir).current
        if not create:
            return
        if not self.state_dir.exists():
            make_dir(self.state_dir, SHARED_DIR)  # the inference server's group traverses it to the versions
        make_dir(self.adapters, SHARED_DIR)

    def new_tmp_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.adapters))

    def path_of(self, name: str, version: int) -> Path:
        return self.adapters / version_name(name, version)

    def publish(self, tmp: Path, name: str, version: int, manifest: dict[str, Any]) -> Path:
        """Seal tmp (adapter files already in it) as version `version`; returns the final path."""
        final = self.path_of(name, version)
        if final.exists() or final.is_symlink():
            raise FileExistsError(f"{final} exists: versions are write-once and names are never reused")
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
        manifest = {**manifest, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        seal_tree(tmp)  # group-readable, read-only, whatever the umask: the inference server reads it
        fsync_tree(tmp)
        reached(VERSION_WRITTEN)
        os.rename(tmp, final)
        fsync_dir(self.adapters)
        reached(VERSION_RENAMED)
        return final

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest, after checking every file it lists; IntegrityError names what is wrong."""
        mf = Path(path) / MANIFEST
        if not mf.is_file():
            raise IntegrityError(f"{path}: no {MANIFEST}")
        try:
            manifest = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            raise IntegrityError(f"{path}: {MANIFEST} cannot be read ({e})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
            raise IntegrityError(f"{path}: {MANIFEST} is not a nightshift manifest")
        for fname, digest in manifest.get("files", {}).items():
            f = Path(path) / fname
            if not f.is_file():
                raise IntegrityError(f"{path}: {fname} is missing")
            if sha256_file(f) != digest:
                raise IntegrityError(f"{path}: {fname} does not match its sha256 in the manifest "
                                     "(truncated or altered)")
        if not manifest.get("files"):
            raise IntegrityError(f"{path}: the manifest lists no files")
        return manifest

    def promote(self, path: Path) -> None:
        """Point `current` at path atomically (verified first)."""
        self.verify(path)
        tmp_link = self.state_dir / f".current.{os.getpid()}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(os.path.relpath(path, self.state_dir), tmp_link)
        os.replace(tmp_link, self.current_link)
        fsync_dir(self.state_dir)
        reached(CURRENT_SWAPPED)

    def current_problem(self) -> str | None:
        """What is wrong with `current` as it is on disk (None: absent, or a link to a directory)."""
        link = self.current_link
        if link.is_symlink():
            target = self.state_dir / os.readlink(link)
            return None if target.is_dir() else f"`current` points at {os.readlink(link)}, which does not exist"
        if link.exists():
            return f"{link} is not a symbolic link (nightshift only ever makes it a link)"
        return None

    def current(self) -> Path | None:
        if not self.current_link.is_symlink():
            return None
        target = (self.state_dir / os.readlink(self.current_link)).resolve()
        return target if target.is_dir() else None

    def current_version(self) -> int | None:
        cur = self.current()
        return parse_version(cur.name) if cur else None

    def clean_stale(self) -> list[Path]:
        """Remove half-written versions left by a crash (call with the state lock held)."""
        stale = [p for p in self.adapters.iterdir() if p.name.startswith(TMP_PREFIX)]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return stale
