"""The quarantine: every record (or file) that could not be trained on, kept with its reason.

One JSONL file per run in `<state>/quarantine/` (private: it holds raw user data): file, line,
reason, detail and the record itself, or, when it is larger than `excerpt_bytes`, a bounded excerpt
plus its size and sha256 (a 200 MB line costs 16 KiB here, and can still be found by its hash).
Files older than `keep_days` are removed at the start of each pull (the ledger keeps one row per
quarantined record, without its content, for good).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from jobs.contract.crashpoints import declare, reached
from jobs.data.inbox import printable
from jobs.store.files import PRIVATE_DIR, PRIVATE_FILE, make_dir

log = structlog.get_logger("nightshift.pull")
SYNCED = declare("quarantine.synced", "quarantined records are on disk (fsync), the ledger not told yet")


class QuarantineConfig(BaseModel):
    """[quarantine]: what is kept of rejected records, and for how long."""

    model_config = ConfigDict(extra="forbid")
    keep_days: float = Field(30.0, gt=0, description="quarantine files older than this are removed")
    excerpt_bytes: int = Field(16384, ge=256, le=1 << 24,
                               description="a rejected record larger than this is kept as an excerpt + sha256")


class Quarantine:
    """Append-only JSONL of rejected records for one run; `sync()` makes what was added durable."""

    def __init__(self, path: Path, *, excerpt_bytes: int = 16384) -> None:
        self.path = Path(path)
        self.excerpt_bytes = excerpt_bytes
        self._f: Any = None

    def add(self, *, source: str, file: str | Path, line: int | None, reason: str, detail: str,
            record: Any = None, raw: str | None = None, size: int | None = None, sha256: str | None = None,
            item: int | None = None) -> None:
        entry: dict[str, Any] = {"source": source, "file": printable(file), "line": line, "reason": reason,
                                 "detail": printable(detail, 2000)}
        if item is not None:  # the element of a JSON array (several can share a line)
            entry["item"] = item
        if record is not None:
            text = _json(record)
            if text is not None and len(text) <= self.excerpt_bytes:
                entry["record"] = record
            else:
                raw = text if text is not None else printable(repr(record), self.excerpt_bytes * 2)
        if raw is not None:
            data = raw.encode("utf-8", "backslashreplace")
            if len(data) > self.excerpt_bytes:
                entry.update(raw=data[: self.excerpt_bytes].decode("utf-8", "ignore"), truncated=True,
                             bytes=size or len(data), sha256=sha256 or hashlib.sha256(data).hexdigest())
            else:
                entry["raw"] = raw
                if size is not None:  # an excerpt the reader already cut from a larger record
                    entry.update(truncated=True, bytes=size, sha256=sha256)
        line_text = json.dumps(entry, ensure_ascii=False, default=str) + "\n"
        self._file().write(line_text.encode("utf-8", "backslashreplace"))

    def _file(self) -> Any:
        if self._f is None:
            make_dir(self.path.parent, PRIVATE_DIR)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
            self._f = os.fdopen(fd, "ab")
        return self._f

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            reached(SYNCED)

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None


def _json(record: Any) -> str | None:
    try:
        return json.dumps(record, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        return None


def prune_quarantine(directory: Path, keep_days: float, *, now: float | None = None,
                     keep: Path | None = None) -> list[str]:
    """Remove quarantine files last written more than `keep_days` ago; returns their names."""
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        entries = list(Path(directory).glob("*.jsonl"))
    except OSError:
        return gone
    for p in entries:
        try:
            if p != keep and now - p.stat().st_mtime > keep_days * 86400:
                p.unlink()
                gone.append(p.name)
        except OSError:
            continue
    if gone:
        log.info("quarantine_pruned", files=gone, keep_days=keep_days)
    return gone
