"""Advisory locks in the state directory (flock). The kernel drops a lock when the last process
holding it dies, so a crash never leaves one behind.

Two levels, always taken in this order:
- `night.lock`: one night (or calibration) at a time per state directory. Held by whoever runs one
  (`nightshift run` while a night runs, `once`, `plan`, `calibrate`) for as long as it runs, and
  inherited by the night's child process (its file descriptor is passed on), so a supervisor killed
  with -9 does not free the state directory while its child still writes to it.
- `lock`: the registry lock, held for seconds around every change of the versions or of `current`
  (the night's publish, the `adapters` commands), so those never interleave.
(`hotswap.lock`, around announcing, comes after `lock` and never the other way round.)

The night lock is taken on the state directory itself (its inode), not on a file in it: deleting
`night.lock` (which only says who holds it) cannot let a second night in beside the first.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from jobs.store.files import SHARED_DIR, make_dir
from jobs.store.paths import StatePaths

LOCK_FD_ENV = "NIGHTSHIFT_NIGHT_LOCK_FD"  # the night's child: the inherited night lock's descriptor


class LockTimeout(RuntimeError):
    """Another nightshift process holds the lock (the message names it): exit status BUSY (5)."""


def holder(path: Path) -> str:
    """Who holds a lock, as its holder wrote it: 'pid 123: nightshift once, since 01:02:03' ('' unknown)."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""
    pid, _, rest = text.partition(" ")
    what, _, since = rest.partition("|")
    if not pid.isdigit():
        return ""
    when = f", since {time.strftime('%H:%M:%S', time.localtime(float(since)))}" if _is_float(since) else ""
    return f"pid {pid}" + (f": {what.strip()}" if what.strip() else "") + when


def _is_float(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


class StateLock:
    """`with StateLock(path, timeout=..., what=...)`: wait up to `timeout` seconds (0: try once),
    else LockTimeout naming the holder. `fd` is the descriptor to pass to a child that must keep
    holding it (the lock is released when every process holding the descriptor has closed it)."""

    def __init__(self, path: Path, *, timeout: float = 60.0, what: str = "", inode: Path | None = None,
                 shared: bool = False) -> None:
        """`inode`: lock this (a directory that stays) instead of `path`, which then only names the holder.
        `shared`: a reader's lock (doctor) on an existing lock file: it keeps writers out, lets other readers
        in, and writes nothing (a read-only command leaves the state directory as it was)."""
        self.path = Path(path)
        self.timeout = timeout
        self.what = what
        self.inode = inode
        self.shared = shared
        self.fd: int | None = None

    def __enter__(self) -> StateLock:
        if self.shared:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        else:
            if not self.path.parent.exists():
                make_dir(self.path.parent, SHARED_DIR)  # the state directory: its group reads the versions in it
            fd = (os.open(self.inode, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if self.inode is not None
                  else os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        end = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    os.close(fd)
                    waited = f"waited {self.timeout:g} s" if self.timeout else "not waiting"
                    purpose = f" for {self.what}" if self.what else ""
                    who = holder(self.path)
                    raise LockTimeout(f"{self.path.parent} is held by another nightshift process"
                                      + (f" ({who})" if who else "") + f" ({waited}{purpose})") from None
                time.sleep(0.05)
        self.fd = fd
        note = f"{os.getpid()} {self.what}|{time.time():.0f}\n".encode()
        if self.shared:
            pass  # a reader writes nothing
        elif self.inode is None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, note, 0)
        else:  # who holds it, for the message of the next one (best effort: the lock does not depend on it)
            try:
                nfd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.write(nfd, note)
                finally:
                    os.close(nfd)
            except OSError:
                pass
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        # close, not LOCK_UN: a child that inherited the descriptor keeps the lock until it exits too
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def night_lock(state_dir: Path, *, timeout: float = 0.0, what: str = "") -> StateLock:
    return StateLock(StatePaths(state_dir).night_lock, timeout=timeout, what=what, inode=Path(state_dir))


def inherited_night_lock(state_dir: Path, environ: dict[str, str] | None = None, *,
                         holder_pid: int | None = None) -> bool:
    """True when this process was handed the state directory's night lock by its parent (checked:
    the descriptor is open on that very directory and the lock is held). `holder_pid`: the descriptor is
    that process's, not ours (a torchrun worker: its launcher got the lock, the worker did not)."""
    raw = (os.environ if environ is None else environ).get(LOCK_FD_ENV, "")
    if not raw.isdigit():
        return False
    try:
        mine = os.stat(f"/proc/{holder_pid}/fd/{raw}") if holder_pid is not None else os.fstat(int(raw))
        there = os.stat(Path(state_dir))
    except OSError:
        return False
    if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
        return False
    probe = os.open(Path(state_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # held: by the descriptor we inherited (ours) or by nobody we could tell apart
    finally:
        os.close(probe)
    return False


def night_running(state_dir: Path) -> bool:
    """Whether a night holds the state directory now (its night lock: the directory's own inode), asked without
    taking it or writing anything (`doctor`, `status`)."""
    try:
        fd = os.open(state_dir, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
