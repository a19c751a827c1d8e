"""The timed window of a step run by a group of ranks (the scaling workloads): warm-up steps, then timed
steps until --max-steps or --seconds, the end decided together (every rank stops at the same step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(group: Any, step: Callable[[], int], *, warmup: int, max_steps: int, seconds: float) -> dict[str, Any]:
    """`step()` runs one global step and returns its tokens (all ranks'); tok/s of the whole group."""
    for _ in range(warmup):
        step()
    _sync()
    t0 = time.perf_counter()
    tokens = steps = 0
    while True:
        tokens += step()
        steps += 1
        done = steps >= max_steps or time.perf_counter() - t0 >= seconds
        if group.agree(done)[0]:
            break
    _sync()
    secs = time.perf_counter() - t0
    return {"timed_steps": steps, "timed_seconds": round(secs, 3), "real_tokens": tokens,
            "real_tok_s": tokens / secs if secs > 0 else None}


def peak_reserved_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_reserved() / 1e9, 2) if torch.cuda.is_available() else None
