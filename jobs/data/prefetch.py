"""Check the inbox's large JSONL files while the night's process imports, before its pull asks for them.

A restarted night's wake is its imports (12-33 s on H100/H200 hosts) and then the pull, plan, load and first step
one after the other; the pull's reading, decoding and checking can be done before the imports end, by the pull's
early workers, which wait idle until then (jobs/data/parallel.py): its wait for them fell from 0.45-0.83 s to
0.11-0.13 s for 60,000 records on 16-core hosts (RESULTS.md: 2026-11-26, wake bytecode; what it still spends is
the ledger's and token cache's writes), and on the 2-core box such a pull went from 12.6-13.5 s to 3.1-3.5 s
(RESULTS.md: 2026-11-26, pull ahead CPU). Only
pure work is done ahead: each worker reads a byte range of a file, decodes and checks its records (the
records that start in the range, with their line numbers) and holds the results. Nothing is ingested,
quarantined or moved: the pull still decides, in order, what each file is and writes the ledger alone. It
takes a file's results only where they are for the file it opened (its device, inode, size, mtime and
ctime), its source's settings and its tokenizer (the pool's); a range whose result does not come back whole is
read and checked by the pull itself, and any other file is checked as it always was.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import sqlite3
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import structlog

from jobs.data import parallel
from jobs.data.check import Checked, Stored, check_for_store
from jobs.data.inbox import InboxFile, list_inbox, open_inbox_file, roots, stat_key
from jobs.data.readers import Limits, foreign_encoding, read_jsonl
from jobs.data.sources import SourceConfig

if TYPE_CHECKING:
    from jobs.data.parallel import CheckPool

log = structlog.get_logger("nightshift.pull")
MAX_BYTES = 256 << 20  # of files checked ahead: their results wait in this process's memory for the pull
RANGE_BYTES = 1 << 20  # a range is at least this (a worker's task), at most 4 per worker
Chunks = list[list[Checked | Stored]]


@dataclass
class Ahead:
    """One file checked ahead: its ranges, in order, and the workers' results for them."""

    file: InboxFile
    key: str  # the file's stat key when it was listed: the pull takes the results only for this file
    src: SourceConfig
    options: dict[str, Any]
    limits: Limits
    ranges: list[tuple[int, int]]
    futures: list[Future[bytes] | None]

    def serves(self, key: str, src: SourceConfig, options: dict[str, Any], limits: Limits) -> bool:
        return (key, src, options, limits) == (self.key, self.src, self.options, self.limits)

    def results(self, fh: IO[bytes], pool: CheckPool) -> Iterator[list[Checked | Stored]]:
        """The file's checked records in order, chunk by chunk; a range whose result does not come back whole (the
        file changed since, a worker failed) is read from `fh` and checked here."""
        for (start, end), fut in zip(self.ranges, self.futures, strict=True):
            chunks: Chunks | None = None
            if fut is not None:
                try:
                    seen, chunks = pickle.loads(fut.result())
                    if seen != self.key:
                        chunks = None  # another file at that path by the time the worker opened it
                except BrokenProcessPool as e:
                    pool.broken(e)
                except Exception as e:
                    log.warning("pull_worker_chunk_failed", error=f"{type(e).__name__}: {e}"[:300],
                                detail="the range is checked in this process")
            if chunks is None:
                chunks = check_range(fh, start, end, self.limits, self.src, pool.tokenizer, self.options)
            yield from chunks


def take(pool: CheckPool, real: Path, key: str, src: SourceConfig, options: dict[str, Any],
         limits: Limits) -> Ahead | None:
    """The file at `real` as `pool` checked it ahead, where it was checked as this pull checks it (the same file,
    source settings and options); else None (the pull checks it)."""
    ahead = pool.ahead.pop(str(real), None)
    return ahead if isinstance(ahead, Ahead) and ahead.serves(key, src, options, limits) else None


def ranges_of(size: int, workers: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges covering `size`: at least RANGE_BYTES each, at most 4 per worker."""
    n = max(1, min(-(-size // RANGE_BYTES), 4 * max(1, workers)))
    bounds = [size * k // n for k in range(n + 1)]
    return list(itertools.pairwise(bounds))


def check_range(fh: IO[bytes], start: int, end: int, lim: Limits, src: SourceConfig, tokenizer: Any,
                options: dict[str, Any]) -> Chunks:
    """The records of the JSONL lines that start in [start, end), checked as the pull checks them."""
    first_line = _seek_line(fh, start)
    raws = read_jsonl(fh, lim, first_line=first_line, stop=end)
    return [check_for_store(c, src, tokenizer, **options) for c in parallel.chunked(raws, parallel.TOKENIZE_BATCH)]


def _seek_line(fh: IO[bytes], start: int) -> int:
    """Put `fh` at the first line that starts at or after `start`; its 1-based line number."""
    if start <= 0:
        fh.seek(0)
        return 1
    fh.seek(start - 1)
    if fh.read(1) != b"\n":  # inside a line: it belongs to the range where it starts
        while (piece := fh.readline(1 << 20)) and not piece.endswith(b"\n"):
            pass
    pos, lines, done = fh.tell(), 0, 0
    fh.seek(0)
    while done < pos and (block := fh.read(min(1 << 20, pos - done))):
        lines += block.count(b"\n")
        done += len(block)
    fh.seek(pos)
    return lines + 1


def _check_file_range(file: InboxFile, allowed: list[Path], start: int, end: int, src: SourceConfig,
                      options: dict[str, Any], lim: Limits) -> bytes:
    """A worker's task: (the stat key of what it opened, the range's checked chunks), pickled."""
    with open_inbox_file(file, allowed) as fh:
        return pickle.dumps((stat_key(os.fstat(fh.fileno())),
                             check_range(fh, start, end, lim, src, parallel.worker_tokenizer(), options)))


def check_ahead(pool: CheckPool, sources: list[SourceConfig], *, options: dict[str, Any], excerpt_bytes: int,
                now: float, ledger_path: Path | None = None) -> None:
    """Give the pool's workers the inbox's large JSONL files not yet ingested (by the ledger's stat keys), up to
    MAX_BYTES; nothing here fails the night (the pull checks whatever was not checked ahead)."""
    known = _ledger(ledger_path)
    budget, files = MAX_BYTES, 0
    try:
        for src in sources:
            allowed = roots(src)
            try:
                listing = list_inbox(src, now=now)
            except OSError:
                continue
            for f in listing.files:
                if f.path.suffix.lower() != ".jsonl":
                    continue
                try:
                    with open_inbox_file(f, allowed) as fh:
                        st = os.fstat(fh.fileno())
                        if foreign_encoding(fh):  # refused whole by the pull: no ranges of it
                            continue
                except OSError:
                    continue
                key = stat_key(st)
                if not parallel.PARALLEL_MIN_BYTES <= st.st_size <= budget or (
                        known is not None and known.file_known_by_stat(src.name, f.display, key)):
                    continue
                lim = src.limits(excerpt_bytes)
                ranges = ranges_of(st.st_size, pool.workers)
                futures = [pool.submit(_check_file_range, f, allowed, a, b, src, options, lim) for a, b in ranges]
                pool.ahead[str(f.real)] = Ahead(f, key, src, options, lim, ranges, futures)
                budget -= st.st_size
                files += 1
    except Exception as e:  # nothing checked ahead is needed: the pull checks it
        log.info("pull_not_checked_ahead", error=f"{type(e).__name__}: {e}"[:300])
    finally:
        if known is not None:
            known.close()
    if files:
        log.info("pull_checking_ahead", files=files, bytes=MAX_BYTES - budget)


def _ledger(path: Path | None) -> Any:
    """The ledger, read-only, where it is of the current schema (an older one is migrated by the night, not
    copied into memory here, before the imports)."""
    from jobs.store.readonly import open_read_only
    from jobs.store.schema import LATEST, schema_version

    try:
        if path is None or not path.is_file():
            return None
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1)) as db:
            if schema_version(db) < LATEST:
                return None
        return open_read_only(path)
    except Exception:
        return None
