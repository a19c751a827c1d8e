"""structlog set-up shared by the daemon and the night's child.

JSON lines when stderr is not a TTY (journald, files), a readable console on a TTY.
Standard-library loggers (APScheduler, transformers, datasets) go through the same
processors, so every line of a run carries its run_id.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer


def configure(level: str = "INFO", fmt: str | None = None, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
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
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared,
                                                             processors=[*final, renderer]))
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
