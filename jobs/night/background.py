"""One call run in a thread while the night's process does other work (issue 11: the wake).

Why: an 8B's model load (2.1 s from the 4-bit cache on an H200) and reading its 72,120 samples' token ids
back from pull's cache (2.3 s) came one after the other before the first step, though neither needs the
other. The thread keeps the caller's logging context (the run id in every line) and CUDA device (a rank
bound to its card: a new thread starts on card 0). Leaving the block waits for the call, so a failure of
the caller's own work never leaves the call running behind it.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


@contextmanager
def in_background(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Iterator[Future[T]]:
    device = _cuda_device()
    context = contextvars.copy_context()

    def work() -> T:
        if device is not None:
            sys.modules["torch"].cuda.set_device(device)
        return context.run(fn, *args, **kwargs)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightshift-background")
    try:
        yield pool.submit(work)
    finally:
        pool.shutdown(wait=True)


def _cuda_device() -> int | None:
    """The caller's current card, where CUDA is already in use (never imports torch itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())
