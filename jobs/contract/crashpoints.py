"""Named crash points: where the product writes durable state, a test can stop the process right there.

Every place that commits something a restart must find (a ledger transaction, a file's fsync or rename, a
checkpoint, the `current` swap, a hot-swap record) calls `reached("name")` just before and/or after it. In
production nothing is set and the call is one dict lookup. A test sets `NIGHTSHIFT_CRASH_AT=name` (optionally
`name@N`: the N-th time the point is reached, counting from 1) in the environment of the process it starts;
that process then kills itself with SIGKILL at that point, as a power cut would, without running `finally`
blocks or flushing buffers. `NIGHTSHIFT_CRASH_RANK` limits it to one rank of a several-process night.
`NIGHTSHIFT_CRASH_HOW=stop` makes the process stop itself there (SIGSTOP) instead: it keeps what a live process
holds (the night lock, an open run) for as long as the test needs, however busy the machine, until the test
kills it or lets it go on (SIGCONT) - where a test must hold a night open, not time it.

`POINTS` lists every point the product declares, so a test can kill a night at each point in turn and
prove the list is complete (a point reached that is not declared raises in tests).
"""

from __future__ import annotations

import os
import signal

ENV = "NIGHTSHIFT_CRASH_AT"
ENV_RANK = "NIGHTSHIFT_CRASH_RANK"
ENV_HOW = "NIGHTSHIFT_CRASH_HOW"
HOW = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}

POINTS: dict[str, str] = {}
"""name -> what has just happened (or is about to) when the point is reached; filled by `declare`."""

_counts: dict[str, int] = {}


def declare(name: str, what: str) -> str:
    """Register a crash point at import time of the module that owns it; returns the name for `reached`."""
    POINTS[name] = what
    return name


def _target() -> tuple[str, int] | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    name, _, nth = raw.partition("@")
    return name, int(nth) if nth else 1


def reached(name: str) -> None:
    """Die here with SIGKILL (or stop, `NIGHTSHIFT_CRASH_HOW=stop`) if a test asked for this point (and this
    rank); otherwise return at once."""
    target = _target()
    if target is None:
        return
    if name not in POINTS:
        raise KeyError(f"crash point {name!r} is reached but was never declared")
    rank = os.environ.get(ENV_RANK)
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if target == (name, _counts[name]):
        how = os.environ.get(ENV_HOW, "kill")
        if how not in HOW:
            raise ValueError(f"{ENV_HOW}={how!r}: expected one of {', '.join(HOW)}")
        os.kill(os.getpid(), HOW[how])
