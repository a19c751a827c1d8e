"""Shared shapes of the hot-swap step: what is sent, what came of it, and the retry loop.

Why a retry loop of our own: every target kind (HTTP server, webhook, command) fails the
same two ways, transiently (timeout, connection refused, 5xx, 429, non-zero exit) or for
good (4xx, TLS verification, missing secret). Transient failures are retried with
exponential backoff (backoff_s, 2*backoff_s, 4*backoff_s, ... capped at MAX_BACKOFF_S);
permanent ones stop at once. The sleep function is injected so tests never wait.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.contract import HotswapOutcome, Method, parse_version_name

MAX_BACKOFF_S = 60.0  # one wait never exceeds a minute, whatever backoff_s and retries are

Sleep = Callable[[float], None]
Clock = Callable[[], float]


@dataclass(frozen=True)
class AdapterRef:
    """The published version to announce (a LoRA adapter, or with method "full" a whole model
    directory). Never read or written here: only its path is sent.

    `name` is the versioned name (`tiny-v0007`): inference servers cache adapters by name,
    so a name is never reused for other weights.
    """

    version: int
    name: str
    path: Path
    base_model: str
    manifest: dict[str, Any] = field(default_factory=dict)
    method: Method = Method.qlora  # full: `path` is a whole model directory, not a LoRA adapter

    def __post_init__(self) -> None:
        parsed = parse_version_name(self.name)
        if parsed is None or parsed[1] != self.version:
            raise ValueError(f"adapter name {self.name!r} is not '<prefix>-v{self.version:04d}'")
        if not Path(self.path).is_absolute():
            raise ValueError(f"adapter path must be absolute (servers resolve it themselves): {self.path}")

    @property
    def digest(self) -> str:
        """8 hex of a sha256 over the adapter's files (names and their sha256 from the manifest, else
        read from disk): two versions of the same number from two state directories differ here."""
        files = self.manifest.get("files") if isinstance(self.manifest, dict) else None
        if not isinstance(files, dict) or not files:
            p = Path(self.path)
            files = ({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir()) if f.is_file()}
                     if p.is_dir() else {"path": str(p)})
        canon = json.dumps(sorted(files.items()), separators=(",", ":")).encode()
        return hashlib.sha256(canon).hexdigest()[:8]

    @property
    def served_name(self) -> str:
        """The name a LoRA server holds this version under: `tiny-v0007-1a2b3c4d`. Never the same
        for other weights (this state directory or another), so a server can never answer a
        request for it from another adapter's weights or prefix-cache blocks."""
        return f"{self.name}-{self.digest}"

    @property
    def prefix(self) -> str:
        """`tiny` for `tiny-v0007`: adapters with this prefix on a server are ours to unload."""
        parsed = parse_version_name(self.name)
        assert parsed is not None  # checked in __post_init__
        return parsed[0]


_SERVED = re.compile(r"(?P<prefix>[A-Za-z0-9_.-]+?)-v(?P<version>\d{4,})(?:-(?P<digest>[0-9a-f]{8}))?")


def parse_served_name(name: str) -> tuple[str, int] | None:
    """`tiny-v0007-1a2b3c4d` (or an older server's `tiny-v0007`) -> ("tiny", 7); else None."""
    m = _SERVED.fullmatch(name)
    return (m["prefix"], int(m["version"])) if m else None


class TargetError(Exception):
    """One attempt failed. `retryable` says whether another attempt can help."""

    def __init__(self, message: str, *, retryable: bool, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.detail = detail or {}


def backoff_delays(retries: int, backoff_s: float) -> list[float]:
    """The waits before retry 1..retries: backoff_s * 2**i, each capped at MAX_BACKOFF_S."""
    return [min(backoff_s * 2**i, MAX_BACKOFF_S) for i in range(retries)]


def with_retries(
    op: Callable[[int], dict[str, Any]],
    *,
    target: str,
    kind: str,
    retries: int,
    backoff_s: float,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any = None,
) -> HotswapOutcome:
    """Run op(attempt) until it returns a detail dict, raises a permanent TargetError or the
    retries run out. Any other exception is a bug in a target, reported as permanent."""
    start = clock()
    delays = backoff_delays(retries, backoff_s)
    attempt = 0
    while True:
        attempt += 1
        try:
            detail = op(attempt)
        except TargetError as e:
            last, retryable, detail = str(e), e.retryable, e.detail
        except Exception as e:  # a target must never take the others down
            last, retryable, detail = f"{type(e).__name__}: {e}", False, {}
        else:
            return HotswapOutcome(target=target, kind=kind, ok=True, attempts=attempt, seconds=clock() - start,
                                  detail=detail)
        if not retryable or attempt > len(delays):
            return HotswapOutcome(target=target, kind=kind, ok=False, attempts=attempt, seconds=clock() - start,
                                  error=last, detail=detail)
        delay = delays[attempt - 1]
        if log is not None:
            log.warning("hotswap.retry", target=target, kind=kind, attempt=attempt, error=last, retry_in_s=delay)
        sleep(delay)
