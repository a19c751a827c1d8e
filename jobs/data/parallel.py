"""Check a file's records in worker processes, chunk by chunk, in order.

Rendering chat templates and tokenising is the pull's work, and it ran in one process: the H200
acceptance's 6-minute night (2026-11-25) pulled 269,407 records in 72.5 s, most of its wake. Large
files are checked by a pool of spawned workers (each holds a copy of the tokenizer); the ledger, the
quarantine and the token cache are still written by the caller alone, in the records' order, so
what a pull records does not depend on the workers. A pool that breaks (a worker killed) hands its
chunks back to the caller's process, which checks them itself; a chunk whose result does not come back
whole (an error in the worker, a result that cannot be rebuilt) is checked there too, and the pool goes on.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import multiprocessing
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

import structlog

from jobs.data.check import Checked, Stored, check_for_store
from jobs.data.readers import RawRecord
from jobs.data.sources import SourceConfig

log = structlog.get_logger("nightshift.pull")
PARALLEL_MIN_BYTES = 4 << 20  # smaller files (~50k short records) are checked here: workers take seconds to start
MAX_WORKERS = 8
READY_SECONDS = 120.0  # for early workers to say which tokenizer they hold (loading it: ~2 s)
AHEAD = 2  # chunks in flight per worker: enough to keep each busy, few enough to bound memory
TOKENIZE_BATCH = 512  # records per call of the tokenizer (its batch encode)
WORKER_NICENESS = 10  # added to a worker's: the night's process (its imports, its writes) comes first
T = TypeVar("T")

_tokenizer: Any = None  # a worker's own copy
_early: CheckPool | None = None  # started while a prewarmed night waits for its window (start_early)


def default_workers() -> int:
    """One process less than the CPUs this process may use (the caller writes the ledger), at most 8; none
    where that leaves one: a single worker only adds its start and the pickling (a 2-core box: a night's
    80,000 records in 13.2 s through one worker, 12.1 s in process)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(MAX_WORKERS, cpus - 1)
    return workers if workers >= 2 else 0


def chunked(it: Iterable[T], n: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for x in it:
        chunk.append(x)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def check_options(*, max_seq_length: int, overlong: str, special_tokens: str) -> dict[str, Any]:
    """What a record is checked with besides its source and the tokenizer (a chunk's task carries it)."""
    return {"max_seq_length": max_seq_length, "overlong": overlong, "special_tokens": special_tokens}


def worker_tokenizer() -> Any:
    """The tokenizer this worker holds (a task's)."""
    return _tokenizer


def _in_background(niceness: int) -> None:
    """A worker is one of several beside the night's own process, which comes first: one thread each (the
    tokenizer's batch encode otherwise starts one per CPU in every worker) at a lower priority. With neither,
    one H200 host's imports took 25.7-30.9 s beside 8 workers checking ahead (whether that host was slow or the
    workers took its CPUs was not separated); on an H100 host, beside workers set so, 30.0-32.7 s against
    29.3-31.1 s alone (RESULTS.md: 2026-11-26, wake bytecode)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with contextlib.suppress(OSError):
        os.nice(niceness)


def _start(tokenizer: bytes, niceness: int) -> None:
    global _tokenizer
    _in_background(niceness)
    _tokenizer = pickle.loads(tokenizer)


def _start_from(model_path: str, niceness: int) -> None:
    """A worker started before its night has a tokenizer (the night's process imports Unsloth before
    transformers) loads it from the model's directory itself."""
    global _tokenizer
    from jobs.training.loaded import load_tokenizer

    _in_background(niceness)
    _tokenizer = load_tokenizer(Path(model_path))


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _check(raws: list[RawRecord], src: SourceConfig, options: dict[str, Any]) -> bytes:
    """Pickled here, unpickled by the caller inside its guard: a result that cannot be rebuilt there costs
    its chunk (checked again by the caller), not the pool (the executor breaks on a result it cannot read)."""
    return pickle.dumps(check_for_store(raws, src, _tokenizer, **options))


def _ready() -> str:
    """A worker's first task: it has spawned, imported and taken the tokenizer; which one (its digest)."""
    return _digest(pickle.dumps(_tokenizer))


def start_early(model_path: Path, workers: int | None = None) -> CheckPool | None:
    """Start the pull's workers now, as the night's process starts: each spawns, imports and loads the
    model's tokenizer (3.5 s for 2 workers with the test tokenizer on a 2-core box) while that process
    imports Unsloth (~21 s on an H200 host) or waits for its window. A night's pull of 60,000 records on
    an H200 host took 7.1-8.3 s starting its own workers; with these, its file took 3.6-4.5 s in a child
    started inside its window (RESULTS.md: 2026-11-26, wake restart), 3.7 s in a prewarmed one."""
    global _early
    n = default_workers() if workers is None else workers
    if n >= 2 and _early is None:
        _early = CheckPool(None, n, model_path=model_path)
        _early.warm()
    return _early


def pool_for(tokenizer: Any, workers: int) -> CheckPool:
    """The early pool where it serves this tokenizer with this many workers, else a new one."""
    global _early
    pool, _early = _early, None
    if pool is not None and pool.serves(tokenizer, workers):
        log.info("pull_workers_started_early", workers=workers)
        pool.tokenizer = tokenizer  # what this process checks a chunk with if the workers fail it
        return pool
    if pool is not None:
        pool.close()
    return CheckPool(tokenizer, workers)


def close_early() -> None:
    """The night's pulls are over: an early pool none of them needed stops holding its processes."""
    global _early
    pool, _early = _early, None
    if pool is not None:
        pool.close()


def pull_done(pool: CheckPool | None) -> None:
    """A pull is over: its pool, and an early one it did not take, stop; unless one still holds files checked
    ahead for a later pull of the same night ([[adapters]]: each adapter's pull in turn, the night closes it
    after the last with close_early). Closed, the pulls of adapters 2-4 of a night of four started workers of
    their own and checked their files again: 5.6-7.9 s each on an H200 host
    (RESULTS.md: 2026-11-28, four adapters vs one, equal tokens (2x H200))."""
    global _early
    early, _early = _early, None
    kept: CheckPool | None = None
    for p in (pool, early):
        if p is None or p is kept:
            continue
        if kept is None and p.ahead and p.pool is not None:
            kept = p
        else:
            p.close()
    _early = kept


class CheckPool:
    """Workers that check chunks of records; `checked` yields each chunk's results in order."""

    def __init__(self, tokenizer: Any, workers: int, *, model_path: Path | None = None) -> None:
        """Workers holding `tokenizer`, or (`model_path`) the tokenizer each loads from that directory."""
        self.tokenizer, self.workers = tokenizer, workers
        self.pool: ProcessPoolExecutor | None = None
        self.blob = b""
        self.ready: Future[str] | None = None  # a worker's tokenizer digest (warm)
        self.ahead: dict[str, Any] = {}  # files checked ahead: jobs/data/prefetch.py's Ahead, by the path opened
        try:
            if model_path is None:
                self.blob = pickle.dumps(tokenizer)
            # the niceness as the creating process has it (a worker's own import would read the default)
            start, args = ((_start, (self.blob, WORKER_NICENESS)) if model_path is None
                           else (_start_from, (str(model_path), WORKER_NICENESS)))
            self.pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),  # no fork of a CUDA process
                initializer=start, initargs=args)
        except Exception as e:  # a tokenizer that cannot be pickled, no processes left: this one checks
            log.warning("pull_workers_unavailable", error=f"{type(e).__name__}: {e}"[:300])

    def warm(self) -> None:
        """Spawn every worker now (the executor starts them as tasks arrive)."""
        for _ in range(self.workers):
            if self.pool is not None:
                try:
                    fut = self.pool.submit(_ready)
                    self.ready = self.ready or fut
                except Exception as e:
                    self.broken(e)

    def serves(self, tokenizer: Any, workers: int) -> bool:
        """Running, with `workers` workers holding this tokenizer: the same pickled bytes, or for workers that
        loaded it themselves, the same digest (a worker that could not load it: not served)."""
        try:
            if self.pool is None or workers != self.workers:
                return False
            mine = pickle.dumps(tokenizer)
            if self.blob:
                return mine == self.blob
            return self.ready is not None and self.ready.result(timeout=READY_SECONDS) == _digest(mine)
        except Exception:
            return False

    def checked(self, chunks: Iterable[list[RawRecord]], src: SourceConfig,
                **options: Any) -> Iterator[list[Checked | Stored]]:
        in_flight: collections.deque[tuple[list[RawRecord], Future[bytes] | None]] = collections.deque()
        for chunk in chunks:
            in_flight.append((chunk, self.submit(_check, chunk, src, options)))
            if len(in_flight) >= AHEAD * self.workers:
                yield self._result(*in_flight.popleft(), src, options)
        while in_flight:
            yield self._result(*in_flight.popleft(), src, options)

    def submit(self, fn: Callable[..., bytes], *args: Any) -> Future[bytes] | None:
        """A task for the workers; None where there are none (the caller does it itself)."""
        if self.pool is None:
            return None
        try:
            return self.pool.submit(fn, *args)
        except Exception as e:  # a broken or shut pool: this process checks the rest
            self.broken(e)
            return None

    def _result(self, chunk: list[RawRecord], fut: Future[bytes] | None, src: SourceConfig,
                options: dict[str, Any]) -> list[Checked | Stored]:
        if fut is not None:
            try:
                return pickle.loads(fut.result())
            except BrokenProcessPool as e:  # a worker died: this process checks the rest
                self.broken(e)
            except Exception as e:  # this chunk's result did not come back whole: this process checks it
                log.warning("pull_worker_chunk_failed", error=f"{type(e).__name__}: {e}"[:300], records=len(chunk),
                            detail="the chunk is checked in this process")
        return check_for_store(chunk, src, self.tokenizer, **options)

    def broken(self, e: Exception) -> None:
        if self.pool is not None:
            log.warning("pull_workers_failed", error=f"{type(e).__name__}: {e}"[:300],
                        detail="the records are checked in this process from here on")
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def close(self) -> None:
        """Every result is in: the workers exit on their own while the night goes on. Waiting for them (each
        tears down an interpreter holding transformers) took 2.1 s for 4 workers on the 2-core box, on the
        wake's path between the pull and the plan."""
        self.ahead.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
