"""The stacks the benchmark measures, one module each; each module's `run(settings, job)` is a worker.

A worker runs in a process of its own (`python -m benchmarks worker --stack NAME`, spawned by the
parent): Unsloth patches transformers at import, and a process's exit frees every byte of VRAM
between stacks. Modules are imported only in that worker, never by the parent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.worker_table import WORKERS

if TYPE_CHECKING:
    from benchmarks.settings import BenchSettings
    from benchmarks.stacks.common import Job


def worker(name: str) -> Callable[[BenchSettings, Job], None]:
    """The worker function of a stack (imports its module: call it in the worker process only)."""
    if name not in WORKERS:
        raise KeyError(f"unknown stack {name!r}; known: {', '.join(WORKERS)}")
    return importlib.import_module(f"benchmarks.stacks.{name}").run
