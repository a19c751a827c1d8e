"""At a terminal, one stream: the plan, the progress, the summary (issue 42).

`once` and `plan` run by a person at a TTY used to interleave structlog's console lines (`child_started`,
`imported ... without_bytecode=83`, `step_shape basis=...`) with the progress display. There, the structured
log (the daemon's and the night's child's, as JSON lines) goes to a file under the state directory
(`<state_dir>/logs/once-<time>.jsonl`; `plan` writes nothing, so its log is dropped), and only warnings and
errors, what an operator can act on, reach the terminal as one short line each. Not at a TTY (the service,
a pipe, CI), or with `[log] format` / NIGHTSHIFT_LOG_FORMAT set, logging is as configured: stderr, the journal.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from jobs.runtime import logs
from jobs.store.paths import StatePaths

INTERACTIVE = ("once", "plan")
KEEP_LOGS = 20  # once-*.jsonl files kept in <state_dir>/logs
SHORT = 160  # a warning's terminal line, at most (two lines of a terminal; a quarantined record's took three)
_QUIET_KEYS = {"event", "level", "logger", "timestamp", "run_id", "night", "rank"}
_child: dict[str, TextIO | None] = {"stream": None}


def at_terminal(cmd: str, log_format: str, environ: Mapping[str, str], stderr: TextIO) -> bool:
    """A person is watching this command's progress display: logs go elsewhere."""
    return (cmd in INTERACTIVE and log_format == "auto" and not environ.get("NIGHTSHIFT_LOG_FORMAT")
            and stderr.isatty())


def warning_line(line: str) -> str | None:
    """The terminal's line for a JSON log line of level warning or worse; None for the rest."""
    try:
        rec = json.loads(line.lstrip("<01234567>"))  # a priority prefix, if any
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("level") not in ("warning", "error", "critical"):
        return None
    extra = " ".join(f"{k}={v}" for k, v in rec.items() if k not in _QUIET_KEYS and v is not None)  # no line=None
    line = f"{rec['level']}: {rec.get('event')}" + (f" ({extra})" if extra else "")
    return line if len(line) <= SHORT else line[:SHORT - 1] + "…"  # the whole record is in the log file


class LogTee(io.TextIOBase):
    """Every line to `file`; warnings and errors, shortened, to the terminal (looked up at each write: while
    the progress bar is live, rich's proxy that prints above it). Not a TTY: the child logs JSON into it."""

    def __init__(self, file: TextIO, terminal: TextIO | None = None) -> None:
        self.file, self._terminal, self._partial = file, terminal, ""

    def write(self, text: str) -> int:
        self.file.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if (short := warning_line(line)) is not None:
                (self._terminal or sys.stderr).write(short + "\n")
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False


def route_logs(cmd: str, s: Any, *, stderr: TextIO | None = None, environ: Mapping[str, str] | None = None,
               clock: Any = time.time) -> Path | None:
    """Set up logging for `cmd`; returns the log file a person is told about (None: logs go where configured)."""
    err = stderr or sys.stderr
    env = os.environ if environ is None else environ
    if not at_terminal(cmd, s.log.format, env, err):
        logs.configure(s.log.level, None if s.log.format == "auto" else s.log.format)
        _child["stream"] = None
        return None
    path: Path | None = None
    sink: TextIO | None = None
    if cmd == "once":  # a night writes the state directory anyway
        folder = StatePaths(s.state_dir).once_logs
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = folder / time.strftime("once-%Y%m%d-%H%M%S.jsonl", time.localtime(clock()))
            for old in sorted(folder.glob("once-*.jsonl"))[:-KEEP_LOGS + 1]:
                old.unlink(missing_ok=True)
            sink = open(path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the command)
        except OSError:  # an unwritable state directory: the night's pre-flight says so, clearly
            path = None
    if sink is None:  # plan changes nothing, not even a log file
        sink = open(os.devnull, "w")  # noqa: SIM115
    tee = LogTee(sink, None if stderr is None else stderr)
    logs.configure(s.log.level, "json", stream=tee, priority_prefix=False)  # type: ignore[arg-type]
    _child["stream"] = tee  # type: ignore[assignment]
    return path


def child_log_stream() -> TextIO | None:
    """Where the night's child's log lines are relayed (None: stderr, as before)."""
    return _child["stream"]
