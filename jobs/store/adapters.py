"""Operator actions on published adapter versions: list, show, diff, promote, rollback, pin, prune.

No network here: telling the servers (announcing a version, promote/rollback that also tell them) is
jobs.hotswap.versions, above the store. Imports no torch: the daemon's CLI runs these. Two locks in
the state directory:
- `lock` (the one the night's publish takes) around every change of the registry or of `current`,
  held for file operations only (seconds), so a running night is never kept waiting long;
- `hotswap.lock` around announcing (network, retries: up to minutes). Whoever announces checks,
  under it, that the version is still the one in service, so announcements never cross: the last
  one the targets hear is the version behind `current`.
Locks are always taken in that order and `lock` is never requested while `hotswap.lock` is held.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from jobs.contract.crashpoints import declare, reached
from jobs.store.integrity import ledger_in_service
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from jobs.store.registry import TMP_PREFIX, Registry, parse_version

log = structlog.get_logger("nightshift.adapters")
# Where a kill leaves an operator command (tests/store/test_operator_crash_points.py kills each one):
PROMOTION_RECORDED = declare("adapters.promotion_recorded", "a promote/rollback is in the ledger, `current` not "
                             "yet moved (re-running the command or the next night moves it)")
PIN_RECORDED = declare("adapters.pin_recorded", "a pin or unpin and its event are in the ledger")
PRUNED_RECORDED = declare("adapters.pruned_recorded", "the ledger marks a version pruned; its directory is still "
                          "published (re-running prune removes it)")
PRUNED_RENAMED = declare("adapters.pruned_renamed", "a pruned version is renamed to .tmp-pruned-*, not yet deleted "
                         "(re-running prune or the next publish deletes it)")
PRUNING = f"{TMP_PREFIX}pruned-"
KEPT_STATUSES = ("promoted", "rejected")  # published and on disk


class RegistryConfig(BaseModel):
    """[registry]: retention of published versions and how long commands wait for the lock."""

    model_config = ConfigDict(extra="forbid")
    keep_promoted: int = Field(
        5,
        ge=1,
        description="prune keeps this many most recently promoted versions (plus pinned ones and the one in service)",
    )
    keep_promoted_full: int = Field(
        2, ge=1, description="of those, at most this many full fine-tuned versions (each is a whole model)")
    lock_timeout_seconds: float = Field(
        120.0, gt=0, description="how long a command waits for a running night's publish or another command"
    )


class AdapterError(RuntimeError):
    """An operator request that cannot be done as asked; the message says why and what stays."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    name: str
    status: str  # training | promoted | rejected | failed | pruned
    parent: int | None
    path: Path
    in_service: bool
    pinned: bool
    created_at: float
    promoted_at: float | None
    manifest: dict[str, Any]

    @property
    def on_disk(self) -> bool:
        return self.path.is_dir()

    @property
    def missing(self) -> bool:
        """Kept by the ledger but its directory is gone, and not by `prune`: damage (`nightshift doctor`)."""
        return self.status in KEPT_STATUSES and not self.on_disk

    @property
    def method(self) -> str:
        """qlora | lora (a LoRA adapter) | full (a whole model directory)."""
        return str(self.manifest.get("method") or "qlora")

    @property
    def size_bytes(self) -> int | None:
        if self.on_disk:
            return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
        return self.manifest.get("size_bytes")


@dataclass
class PruneResult:
    deleted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> why
    left_alone: list[str] = field(default_factory=list)  # not ours to judge: .tmp-*, unknown dirs
    freed_bytes: int = 0  # on disk, of the deleted versions


class Adapters:
    """The registry and the ledger together, for one state directory."""

    def __init__(
        self,
        state_dir: Path,
        *,
        cfg: RegistryConfig | None = None,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        """`read_only`: for the commands that only read (list, show, diff): nothing is created or migrated,
        and a state directory this user cannot write still reads."""
        self.state_dir = Path(state_dir)
        self.registry = Registry(self.state_dir, create=not read_only)
        path = StatePaths(self.state_dir).ledger
        self.ledger = open_read_only(path, clock=clock) if read_only else Ledger(path, clock=clock)
        self.cfg = cfg or RegistryConfig()

    def close(self) -> None:
        self.ledger.close()

    @contextmanager
    def lock(self, what: str) -> Iterator[None]:
        with StateLock(StatePaths(self.state_dir).lock, timeout=self.cfg.lock_timeout_seconds, what=what):
            yield

    # ---- reading --------------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        current = self.registry.current()
        pinned = self.ledger.pinned()
        out = []
        for r in self.ledger.versions():
            path = self.registry.adapters / r["name"]
            out.append(
                VersionInfo(
                    version=int(r["version"]),
                    name=r["name"],
                    status=r["status"],
                    parent=None if r["parent"] is None else int(r["parent"]),
                    path=path,
                    in_service=current is not None and current == path.resolve(),
                    pinned=int(r["version"]) in pinned,
                    created_at=float(r["created_at"]),
                    promoted_at=r["promoted_at"],
                    manifest=_manifest(path, r["manifest"]),
                )
            )
        return out

    def get(self, ref: str | int) -> VersionInfo:
        v = self.resolve(ref)
        for info in self.versions():
            if info.version == v:
                return info
        raise AdapterError(f"no version {ref!r} in the ledger (`nightshift adapters list` lists them)")

    def resolve(self, ref: str | int) -> int:
        """3, "3", "v3", "v0003", "tiny-v0003" or "current" -> 3."""
        s = str(ref).strip()
        if s == "current":
            v = self.registry.current_version()
            if v is None:
                raise AdapterError("no version is in service (`current` is not set)")
            return v
        digits = s.lstrip("v") if s.lstrip("v").isdigit() else None
        v = int(digits) if digits is not None else parse_version(s)
        if v is None:
            raise AdapterError(f"{ref!r} is not a version (give 3, v0003 or <name>-v0003)")
        return v

    def service_history(self) -> list[int]:
        """The versions that were put in service, as a stack: a promotion pushes, a rollback pops
        back to its target. The top is normally `current`; rollback goes to the one below it."""
        rows = self.ledger.promotions()
        first_at = float(rows[0]["at"]) if rows else float("inf")
        stack = [
            int(r["version"])
            for r in sorted(self.ledger.versions(), key=lambda r: r["promoted_at"] or 0)
            if r["promoted_at"] is not None and r["promoted_at"] < first_at
        ]  # promoted before this log
        for r in rows:
            v = int(r["version"])
            if r["action"] == "rollback":
                while stack and stack[-1] != v:
                    stack.pop()
                if not stack:
                    stack.append(v)
            elif not stack or stack[-1] != v:
                stack.append(v)
        return stack

    # ---- changing what is in service ----------------------------------------------------------
    def promote(self, ref: str | int) -> tuple[VersionInfo, int | None]:
        """Verify, then move `current` to the version (atomically) and record it. Returns the version
        and the one it replaced. IntegrityError: refused, the one in service stays."""
        with self.lock("promote"):
            return self._promote(self.get(ref), "promote")

    def rollback(self) -> tuple[VersionInfo, int | None]:
        """Back to the version in service before the current one (one command)."""
        with self.lock("rollback"):
            return self._promote(self.rollback_target(), "rollback")

    def rollback_target(self) -> VersionInfo:
        current = self.registry.current_version()
        kept = {i.version: i for i in self.versions() if i.status in KEPT_STATUSES and i.on_disk}
        for v in reversed(self.service_history()):
            if v != current and v in kept:
                return kept[v]
        raise AdapterError(
            "no earlier promoted version is kept to roll back to"
            + (f" ({kept[current].name} stays in service)" if current in kept else "")
        )

    def _promote(self, info: VersionInfo, action: str) -> tuple[VersionInfo, int | None]:
        """The ledger first (status, the move, its event: one transaction), then `current`. A kill between
        the two leaves the ledger ahead of `current`: re-running the command finishes the move without
        recording it twice, and the next night moves `current` to what the ledger says (jobs/store/integrity)."""
        previous = self.registry.current_version()
        if info.missing:
            raise AdapterError(f"{info.name} cannot be promoted: its directory {info.path} is missing (it was not "
                               "pruned): restore it from a backup (`nightshift doctor` lists what is missing)")
        if info.status not in KEPT_STATUSES or not info.on_disk:
            raise AdapterError(
                f"{info.name} cannot be promoted: it is {info.status}" + ("" if info.on_disk else " and not on disk")
            )
        recorded = ledger_in_service(self.ledger) == info.version
        if previous == info.version and recorded:
            raise AdapterError(f"{info.name} is already in service (`nightshift hotswap` re-sends it)")
        self.registry.verify(info.path)
        if recorded:  # a move a kill cut before `current`: finish it
            log.warning(f"{action}.finished", version=info.name, current_was=previous,
                        why="the ledger already records it; `current` had not moved yet")
        else:
            with self.ledger.tx() as c:
                self.ledger.set_version(c, info.version, status="promoted", promoted=True)
                self.ledger.record_promotion(c, info.version, action=action, from_version=previous)
                self.ledger.add_event(action, version=info.version, detail={"from_version": previous})
            reached(PROMOTION_RECORDED)
        self.registry.promote(info.path)
        log.info(action, version=info.name, from_version=previous)
        return self.get(info.version), previous

    def set_pinned(self, ref: str | int, pinned: bool) -> VersionInfo:
        with self.lock("pin" if pinned else "unpin"):
            info = self.get(ref)
            if pinned and info.status == "pruned":
                raise AdapterError(f"{info.name} was pruned: its files are gone")
            with self.ledger.tx():  # the pin and its event together
                self.ledger.set_pinned(info.version, pinned)
                self.ledger.add_event("pinned" if pinned else "unpinned", version=info.version)
            reached(PIN_RECORDED)
        return self.get(info.version)

    # ---- retention ------------------------------------------------------------------------------
    def prune(self, *, dry_run: bool = False) -> PruneResult:
        """Keep the last `keep_promoted` promoted versions, pinned ones, the one in service, versions
        being trained and their parents; delete the other published ones (marked 'pruned' in the
        ledger: their names are never reused). `.tmp-*` directories and directories the ledger does
        not know are never touched here."""
        res = PruneResult()
        with self.lock("prune"):
            infos = self.versions()
            keep: dict[int, str] = {}
            current = self.registry.current_version()
            if current is not None:
                keep[current] = "in service"
            recorded = ledger_in_service(self.ledger)  # differs from `current` only after a kill
            if recorded is not None:
                keep.setdefault(recorded, "in service (the ledger)")
            for i in infos:
                if i.status == "training":
                    keep.setdefault(i.version, "being trained")
                    if i.parent is not None:
                        keep.setdefault(i.parent, f"parent of {i.name}, being trained")
                elif i.pinned:
                    keep.setdefault(i.version, "pinned")
            recent = sorted(
                (i for i in infos if i.promoted_at is not None and i.status == "promoted"),
                key=lambda i: i.promoted_at or 0,
                reverse=True,
            )[: self.cfg.keep_promoted]
            full = [i.version for i in recent if i.method == "full"][self.cfg.keep_promoted_full :]
            for i in recent:  # whole models are big: fewer of them are kept
                if i.version not in full:
                    keep.setdefault(i.version, f"among the last {self.cfg.keep_promoted} promoted")
            known = {i.name for i in infos}
            if not dry_run:  # what a killed prune left: unpublished already, only the deletion is left to do
                for p in self.registry.adapters.glob(f"{PRUNING}*"):
                    shutil.rmtree(p, ignore_errors=True)
            res.left_alone = sorted(
                p.name for p in self.registry.adapters.iterdir() if p.name.startswith(TMP_PREFIX) or p.name not in known
            )
            for i in infos:
                if i.version in keep:
                    res.kept[i.name] = keep[i.version]
                elif i.status in KEPT_STATUSES or (i.status in ("failed", "pruned") and i.on_disk):
                    res.deleted.append(i.name)
                    res.freed_bytes += (i.size_bytes or 0) if i.on_disk else 0
                    if not dry_run:
                        self._delete(i)
        if res.deleted and not dry_run:
            log.info("pruned", deleted=res.deleted, kept=res.kept)
        return res

    def _delete(self, info: VersionInfo) -> None:
        """Record (the ledger marks it pruned: its name is never reused), unpublish with one rename (to a
        .tmp-pruned-* name nothing serves), then delete. A kill after the record leaves a pruned version
        on disk, after the rename a .tmp-pruned-* directory: both `nightshift doctor` notes, removed by
        the next prune (and the directory by the next publish)."""
        if info.status != "pruned":
            with self.ledger.tx() as c:
                self.ledger.mark_pruned(c, info.version)
                self.ledger.add_event("pruned", version=info.version, detail={"status_before": info.status})
            reached(PRUNED_RECORDED)
        if info.on_disk:
            gone = Path(tempfile.mkdtemp(prefix=f"{PRUNING}{info.name}-", dir=self.registry.adapters))
            os.rename(info.path, gone / info.name)
            reached(PRUNED_RENAMED)
            shutil.rmtree(gone, ignore_errors=True)


def diff(a: dict[str, Any], b: dict[str, Any], *, ignore: tuple[str, ...] = ("files",)) -> list[tuple[str, Any, Any]]:
    """(key path, value in a, value in b) for every flattened key whose values differ."""
    fa, fb = flatten(a, ignore), flatten(b, ignore)
    missing = object()
    rows = []
    for k in sorted(set(fa) | set(fb)):
        va, vb = fa.get(k, missing), fb.get(k, missing)
        if va != vb:
            rows.append((k, None if va is missing else va, None if vb is missing else vb))
    return rows


def flatten(d: Any, ignore: tuple[str, ...] = (), prefix: str = "") -> dict[str, Any]:
    """{"config": {"train": {"lora_rank": 4}}} -> {"config.train.lora_rank": 4}; lists stay values,
    except lists of dicts (gate checks), flattened by index."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if not prefix and k in ignore:
                continue
            out.update(flatten(v, ignore, f"{prefix}{k}."))
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        for i, v in enumerate(d):
            out.update(flatten(v, ignore, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


def _manifest(path: Path, stored: str | None) -> dict[str, Any]:
    """The manifest on disk, else the copy the ledger keeps (a pruned version still has one)."""
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        try:
            return json.loads(stored) if stored else {}
        except ValueError:
            return {}
