"""Synthetic time zones, so three nights fit in minutes without touching any clock.

Why: a night is keyed by the local date its window starts on (daemon/window.py): one night per
date, as a workstation lives it. The acceptance run needs three nights in a few minutes, so each
window is configured in its own zone whose local date is a different day *now*: UTC-23:xx gives
yesterday, UTC+23:xx tomorrow (Python's offsets may reach 23:59). Every instant stays real: the
daemon, the child and the deadlines run on the real clock; only the nights' names differ. The
zones are TZif files (RFC 8536, no transitions, a POSIX TZ footer) in a directory the daemon
finds through PYTHONTZPATH.
"""

from __future__ import annotations

import datetime as dt
import struct
from pathlib import Path

PREFIX = "NightshiftAcceptance"


def tzif(offset_seconds: int, abbr: str = "NSA") -> bytes:
    """A fixed-offset zone: version 2 header and data blocks, one type, no transitions, a footer."""
    name = abbr.encode() + b"\0"

    def block() -> bytes:
        head = b"TZif2" + b"\0" * 15 + struct.pack(">6l", 0, 0, 0, 0, 1, len(name))
        return head + struct.pack(">lBB", offset_seconds, 0, 0) + name

    sign = "-" if offset_seconds > 0 else "+"  # POSIX TZ: the offset to add to local time to get UTC
    h, rest = divmod(abs(offset_seconds), 3600)
    footer = f"<{abbr}>{sign}{h}:{rest // 60:02d}:{rest % 60:02d}" if offset_seconds else f"<{abbr}>0"
    return block() + block() + b"\n" + footer.encode() + b"\n"


LIMIT = 86399 - 60  # |offset| < 24 h (Python's bound), with a minute to spare


def reachable(start: dt.datetime, day: dt.date) -> int | None:
    """The offset (seconds) that puts `start` on local date `day` near local noon, or None."""
    start = start.astimezone(dt.UTC)
    noon = dt.datetime.combine(day, dt.time(12), tzinfo=dt.UTC)
    offset = max(-LIMIT, min(LIMIT, int((noon - start).total_seconds())))
    return offset if (start + dt.timedelta(seconds=offset)).date() == day else None


def next_night(start: dt.datetime, after: dt.date | None) -> tuple[dt.date, int]:
    """The first local date after `after` (from yesterday on) that `start` can fall on, and its offset."""
    day = start.astimezone(dt.UTC).date() - dt.timedelta(days=1)
    if after is not None:
        day = max(day, after + dt.timedelta(days=1))
    for d in (day, day + dt.timedelta(days=1), day + dt.timedelta(days=2)):
        off = reachable(start, d)
        if off is not None:
            return d, off
    raise ValueError(f"no local date after {after} is reachable from {start:%Y-%m-%d %H:%M:%S} UTC within +-24 h")


def write_zone(root: Path, label: str, offset_seconds: int) -> str:
    """The zone as a file under root; returns its name for `[window] timezone`."""
    name = f"{PREFIX}/{label}"
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tzif(offset_seconds))
    return name
