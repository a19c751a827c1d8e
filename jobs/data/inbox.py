"""Listing a source's inbox and opening its files, without leaving it.

- Patterns match file names case-insensitively (`UPPER.JSONL` is read); a pattern with a `/` is a
  glob below the inbox. Files that match no pattern are reported (logged each pull), never silent.
- A symbolic link is followed only when it resolves inside the inbox or inside a directory of
  `allow_symlinks_to`; any other is refused (reported with where it points, never opened). Files are
  opened with O_NOFOLLOW, and the path the kernel actually opened is checked again, so a link swapped
  in after the listing is not followed either.
- Only regular files are read (a FIFO would block the night, a device is not data).
- Names are shown with undecodable bytes and control characters escaped (a name is data too).
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from jobs.data.sources import SourceConfig

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def printable(text: str | os.PathLike[str], limit: int | None = None) -> str:
    """A name or a message safe for logs, the ledger and JSON: undecodable bytes, lone surrogates
    and control characters escaped."""
    s = os.fsencode(text).decode("utf-8", "backslashreplace") if isinstance(text, os.PathLike) else str(text)
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)
    return out if limit is None or len(out) <= limit else out[: limit - 1] + "…"


@dataclass(frozen=True)
class InboxFile:
    path: Path  # as listed (may be a permitted link)
    real: Path  # what is opened
    display: str  # printable; what the ledger, the quarantine and the logs show
    mtime: float


@dataclass
class Listing:
    files: list[InboxFile] = field(default_factory=list)  # to read, oldest first
    refused: list[tuple[str, str, str]] = field(default_factory=list)  # (file, reason, detail), never opened
    unmatched: list[str] = field(default_factory=list)  # names matching no pattern
    directories: list[str] = field(default_factory=list)  # directories named like data (Spark's `x.parquet/`)


def roots(cfg: SourceConfig) -> list[Path]:
    return [Path(cfg.inbox).resolve(), *(Path(p).resolve() for p in cfg.allow_symlinks_to)]


def _inside(p: Path, allowed: list[Path]) -> bool:
    return any(p == r or p.is_relative_to(r) for r in allowed)


def list_inbox(cfg: SourceConfig, *, now: float) -> Listing:
    """Candidate files (the ledger decides which are new). OSError when the inbox itself is unreadable."""
    inbox = Path(cfg.inbox)
    if not inbox.is_dir():
        raise FileNotFoundError(f"source '{cfg.name}': inbox {printable(inbox)} is not a directory")
    out, allowed = Listing(), roots(cfg)
    simple = [p.lower() for p in cfg.patterns if "/" not in p]
    found: list[Path] = []
    with os.scandir(inbox) as entries:
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):  # reported where a pattern would take its name, never read
                if any(fnmatch.fnmatchcase(e.name.lower(), pat) for pat in simple) and len(simple) == len(cfg.patterns):
                    out.directories.append(printable(Path(e.name)))
                continue
            if any(fnmatch.fnmatchcase(e.name.lower(), pat) for pat in simple):
                found.append(Path(e.path))
            else:
                out.unmatched.append(printable(Path(e.name)))
    for pat in (p for p in cfg.patterns if "/" in p):
        found += [p for p in inbox.glob(pat) if not any(part.startswith(".") for part in p.relative_to(inbox).parts)]
    seen: set[Path] = set()
    for p in found:
        display = printable(p)
        try:
            real, st = admitted(p, allowed)
        except Refused as e:
            out.refused.append((display, e.reason, e.detail))
            continue
        if real in seen or now - st.st_mtime < cfg.settle_seconds:
            continue
        seen.add(real)
        out.files.append(InboxFile(p, real, display, st.st_mtime))
    out.files.sort(key=lambda f: (f.mtime, f.display))
    return out


# what to do about a directory in an inbox (said by the pull's warning and by validate's note)
BELOW_THE_INBOX = "a Spark or Hadoop output directory? a pattern with a '/' reads below the inbox, e.g. " \
                  "'x.parquet/*.parquet'"

class Refused(Exception):
    """A file of the inbox that is not read: (reason, detail) as the quarantine shows them."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def admitted(p: Path, allowed: list[Path]) -> tuple[Path, os.stat_result]:
    """What the inbox opens for `p` (the file it resolves to, and its stat), or Refused: a dangling link, a loop, a
    file gone already, a link out of `allowed`, anything but a regular file."""
    try:
        real = p.resolve(strict=True)
        st = os.stat(real)
    except (OSError, RuntimeError) as e:
        raise Refused("unreadable", f"cannot be opened: {getattr(e, 'strerror', None) or e}") from None
    if not _inside(real, allowed):
        raise Refused("outside_inbox", f"a symbolic link to {printable(real)}, outside the inbox: not followed (list "
                      "its directory in allow_symlinks_to to read it)")
    if not stat.S_ISREG(st.st_mode):
        raise Refused("bad_file", "not a regular file (a FIFO, socket or device): not read")
    return real, st


class LeftInbox(OSError):
    """What was opened is not what was listed (a link swapped in), or not a regular file."""


def open_inbox_file(f: InboxFile, allowed: list[Path]) -> IO[bytes]:
    """Open without following a final symbolic link, non-blocking, then check what the kernel opened."""
    fd = os.open(f.real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LeftInbox(f"{f.display} is not a regular file")
        opened = Path(f"/proc/self/fd/{fd}")
        if opened.is_symlink() and not _inside(Path(os.readlink(opened)), allowed):
            raise LeftInbox(f"{f.display} resolved outside the inbox when opened")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def stat_key(st: os.stat_result) -> str:
    """A file's identity short of its content: device, inode, size, mtime and ctime (which no user can set back)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
