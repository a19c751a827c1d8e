"""What every command that runs a night checks before it starts, and how a user-caused failure ends.

One night at a time per state directory: `once` and `calibrate` take the night lock (`plan` only reads), waiting
up to `[daemon] lock_wait_seconds` (default: not at all) before exiting with status 5 (busy) and a
message naming the holder; the service waits for it instead, and retries until the night's latest
start. A second `nightshift run` on the same state directory exits at once with status 5. Registry
commands (`adapters ...`, `hotswap`) take the registry lock, held for seconds only, and wait up to
`[registry] lock_timeout_seconds`.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import structlog

from daemon.lineage import lineage_notes
from daemon.settings import ConfigError, Settings, check_paths
from jobs.contract import ExitCode
from jobs.store.files import DamagedState, StatePermission
from jobs.store.ledger import Ledger
from jobs.store.locking import LockTimeout, StateLock, night_lock
from jobs.store.paths import StatePaths

log = structlog.get_logger("nightshift.cli")


DISK_FULL = ("free some space on that disk (`nightshift adapters prune`, other files), then run again: what was "
             "written stays, and a night resumes (`nightshift doctor` lists it)")


class Refused(RuntimeError):
    """A pre-flight check failed (free disk): nothing was started."""


def disk_problem(state_dir: Path, min_free_gb: float) -> str | None:
    """Not enough free space where the state directory is (or will be)."""
    where = next((p for p in (Path(state_dir), *Path(state_dir).absolute().parents) if p.exists()), Path("/"))
    free_gb = shutil.disk_usage(where).free / 1e9
    if free_gb < min_free_gb:
        return (f"only {free_gb:.1f} GB free in {where} (need [daemon] min_free_disk_gb = {min_free_gb:g} GB): "
                "free some space (old checkpoints and pruned versions go by themselves: `nightshift adapters prune`)")
    return None


@contextmanager
def before_a_night(s: Settings, config: Path | None, what: str) -> Iterator[StateLock]:
    """The checks of `once` / `calibrate`, in order: paths, free disk, the night lock (returned,
    held), the ledger. Raises ConfigError, DamagedState or LockTimeout, each one clear line."""
    problems = check_paths(s)
    if problems:
        raise ConfigError(config, problems)
    for note in lineage_notes(s):  # a night goes on; said where the operator looks
        print(f"{what}: note: {note}", file=sys.stderr)
        log.warning("config_note", note=note)
    problem = disk_problem(s.state_dir, s.daemon.min_free_disk_gb)
    if problem:
        raise Refused(problem)
    with night_lock(s.state_dir, timeout=s.daemon.lock_wait_seconds, what=what) as lock:
        Ledger(StatePaths(s.state_dir).ledger).close()  # damaged or from a newer release: refused here
        yield lock


class ReaderMayLeave:
    """A command's stdout whose reader may go (`once | head -1`): from then on what it writes goes nowhere, and
    the command goes on to its own exit status (a failed night stays 1, a record to quarantine stays 1), where
    a BrokenPipeError would have ended it with 0 halfway through."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.reader_left()

    def reader_left(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())  # the buffered rest, and the flush at exit, go nowhere
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)


def one_line(command: str, fn: Callable[[], int]) -> int:
    """Run a command; a failure the user can cause ends in one clear line on stderr, not a traceback."""
    stdout = sys.stdout
    sys.stdout = ReaderMayLeave(stdout)  # type: ignore[assignment]
    try:
        code = fn()
        sys.stdout.flush()  # here, not at exit: a reader gone (`status | head -1`) is caught by ReaderMayLeave
        return code
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return ExitCode.USAGE
    except LockTimeout as e:
        print(f"nightshift {command}: {e}. It is safe to run again once that is done"
              " ([daemon] lock_wait_seconds sets how long to wait).", file=sys.stderr)
        return ExitCode.BUSY
    except Refused as e:
        print(f"nightshift {command}: refused: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except StatePermission as e:  # before OSError and DamagedState: a permission is named as one
        print(f"nightshift {command}: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except DamagedState as e:
        print(f"nightshift {command}: refused, the state directory is damaged: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except sqlite3.Error as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            print(f"nightshift {command}: the disk of the state directory is full ({e}): {DISK_FULL}", file=sys.stderr)
        else:
            print(f"nightshift {command}: the ledger cannot be used: {e} (`nightshift doctor` explains)",
                  file=sys.stderr)
        return ExitCode.FAILED
    except OSError as e:  # a full disk, a permission, a path that vanished
        if e.errno == errno.ENOSPC:
            print(f"nightshift {command}: {e.strerror}" + (f": {e.filename}" if e.filename else "") + f": {DISK_FULL}",
                  file=sys.stderr)
            return ExitCode.FAILED
        print(f"nightshift {command}: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""),
              file=sys.stderr)
        return ExitCode.FAILED
    finally:
        sys.stdout = stdout
