"""structlog set-up shared by the daemon and the night's child.

JSON lines when stderr is not a TTY (journald, files), a readable console on a TTY.
Standard-library loggers (APScheduler, transformers, datasets) go through the same
processors, so every line of a run carries its run_id.

Under systemd, when stderr is the journal (JOURNAL_STREAM names it, systemd.exec(5)), each line
starts with its syslog priority, `<3>` for an error ... `<7>` for debug (sd-daemon(3)), which
journald strips and records (SyslogLevelPrefix=yes, the default), so `journalctl -p err` finds
the errors. The night's child writes to a pipe its supervisor relays to the journal: it is told
to prefix too (NIGHTSHIFT_LOG_PRIORITY_PREFIX=1 in its environment, see `child_log_env`).
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from jobs.contract.redact import redact_log_event

PRIORITY_ENV = "NIGHTSHIFT_LOG_PRIORITY_PREFIX"
_state = {"prefix": False}


def syslog_priority(levelno: int) -> int:
    """sd-daemon(3): 2 crit, 3 err, 4 warning, 6 info, 7 debug."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    return 6 if levelno >= logging.INFO else 7


def stream_is_journal(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """True when `stream` is the journal's socket: JOURNAL_STREAM is "<device>:<inode>" of it."""
    env = os.environ if environ is None else environ
    try:
        dev, ino = (int(x) for x in env.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def child_log_env() -> dict[str, str]:
    """What a child process needs to log like this one (priority prefixes when we write to the journal)."""
    return {PRIORITY_ENV: "1"} if _state["prefix"] else {}


class _PriorityFormatter(structlog.stdlib.ProcessorFormatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{syslog_priority(record.levelno)}>" + super().format(record)


def configure(level: str = "INFO", fmt: str | None = None, stream: TextIO | None = None,
              priority_prefix: bool | None = None) -> None:
    """`priority_prefix`: start each line with `<N>`; default: when the stream is the journal or the
    parent process said so."""
    stream = stream or sys.stderr
    if priority_prefix is None:
        priority_prefix = os.environ.get(PRIORITY_ENV) == "1" or stream_is_journal(stream)
    _state["prefix"] = priority_prefix
    fmt = fmt or os.environ.get("NIGHTSHIFT_LOG_FORMAT") or ("console" if stream.isatty() else "json")
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    # Tracebacks without frame locals: locals hold records (user data) and secrets, which must not
    # reach the journal. The frames, the exception type and its message stay.
    renderer = (structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(
        exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False)))
    final = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if fmt == "json":
        final.append(structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)))
    final.append(redact_log_event)  # every line: no URL's secrets (jobs/contract/redact.py)
    handler = logging.StreamHandler(stream)
    formatter = _PriorityFormatter if priority_prefix else structlog.stdlib.ProcessorFormatter
    handler.setFormatter(formatter(foreign_pre_chain=shared, processors=[*final, renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for noisy in ("urllib3", "filelock", "httpx", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def route_transformers_logging() -> None:
    """transformers keeps its own handler; send its records through ours instead."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
