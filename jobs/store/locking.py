"""An advisory lock in the state directory (flock), so registry operations, a publish
and a running night never interleave. The kernel drops it when the holder dies."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType


class LockTimeout(RuntimeError):
    pass


class StateLock:
    def __init__(self, path: Path, *, timeout: float = 60.0, what: str = "") -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.what = what
        self.fd: int | None = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        end = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    os.close(fd)
                    purpose = f" for {self.what}" if self.what else ""
                    raise LockTimeout(f"{self.path} is held by another nightshift process "
                                      f"(waited {self.timeout:g} s{purpose})") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.what}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
