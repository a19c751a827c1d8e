"""Pull: take every new inbox file into the ledger exactly once, and let no input stop the night.

A file is identified by its content hash (sha256): a file replaced by new content is read again
whatever its size and mtime; the same content under another name is read once. (A stat key with the
inode and ctime, which no user can set back, only saves re-hashing a file seen unchanged.) Each file
is ingested in one transaction (file row, samples, quarantine rows), so a crash mid-file leaves
nothing of it recorded and the next run reads it again; a file that changes while it is read is
rolled back and read at the next pull.

Guards: each record is handled inside its own guard (an unexpected error quarantines that record
with reason `internal_error`), each file inside its own (one that vanishes or cannot be opened is
reported as `unreadable` and retried at the next pull; an unexpected error is reported and the
other files go on). Only errors of the ledger itself (a full disk) stop the pull.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from jobs.data.check import Checked, Stored, check_for_store
from jobs.data.formats import RecordError
from jobs.data.inbox import InboxFile, list_inbox, open_inbox_file, printable, roots, stat_key
from jobs.data.parallel import (
    PARALLEL_MIN_BYTES,
    TOKENIZE_BATCH,
    CheckPool,
    check_options,
    chunked,
    close_early,
    default_workers,
    pool_for,
)
from jobs.data.prefetch import take
from jobs.data.quarantine import Quarantine
from jobs.data.readers import Limits, RawRecord, read_stream
from jobs.data.render import OverlongPolicy, SpecialTokens
from jobs.data.sources import SourceConfig
from jobs.data.token_cache import TokenCache
from jobs.store.ledger import Ledger, SampleRow

__all__ = ["PullResult", "Quarantine", "pull"]
log = structlog.get_logger("nightshift.pull")


@dataclass
class PullResult:
    files: int = 0
    ingested: Counter[str] = field(default_factory=Counter)  # source -> new samples
    duplicates: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)  # reason -> records
    unmatched: int = 0  # inbox files matching no pattern (reported, not read)
    incoming: list[SampleRow] = field(default_factory=list)  # preview only: what would become pending


class _Retry(Exception):
    """Not read this time (changed while read): the next pull reads it."""


@dataclass
class _Pull:
    ledger: Ledger
    tokenizer: Any
    run_id: str
    quarantine: Quarantine
    max_seq_length: int
    overlong: OverlongPolicy
    special_tokens: SpecialTokens
    result: PullResult
    token_cache: TokenCache | None = None  # where accepted samples' ids are kept for the night's load
    workers: int = 0  # processes that check a large file's records (jobs/data/parallel.py); 0: this one
    pool: CheckPool | None = None  # started by the first large file, shared by the rest

    def checked(self, src: SourceConfig, f: InboxFile, fh: IO[bytes], key: str, size: int,
                lim: Limits) -> tuple[Iterator[list[Checked | Stored]], bool]:
        """The file's records checked, chunk by chunk, in order: by the workers if it is large (already, where
        they checked it ahead: jobs/data/prefetch.py); and whether they had."""
        options = check_options(max_seq_length=self.max_seq_length, overlong=self.overlong,
                                special_tokens=self.special_tokens)
        chunks = chunked(read_stream(fh, f.path.suffix, lim), TOKENIZE_BATCH)  # (read only where iterated)
        if self.workers == 0 or size < PARALLEL_MIN_BYTES:
            return (check_for_store(c, src, self.tokenizer, **options) for c in chunks), False
        self.pool = self.pool or pool_for(self.tokenizer, self.workers)
        ahead = take(self.pool, f.real, key, src, options, lim)
        if ahead is None:
            return self.pool.checked(chunks, src, **options), False
        return ahead.results(fh, self.pool), True

    def reject(self, conn: sqlite3.Connection | None, src: SourceConfig, file: str, raw: RawRecord,
               err: RecordError) -> None:
        """Quarantine (file and ledger); counted here for a whole file, by the file's own tally for records."""
        if conn is None:
            self.result.quarantined[err.reason] += 1
        self.quarantine.add(source=src.name, file=file, line=raw.line, reason=err.reason, detail=err.detail,
                            record=raw.record, raw=raw.raw, size=raw.size, sha256=raw.sha256)
        detail = printable(err.detail, 500)
        row = {"run_id": self.run_id, "source": src.name, "file": file, "line": raw.line, "reason": err.reason,
               "detail": detail}
        if conn is not None:
            self.ledger.add_quarantine(conn, **row)
        else:
            with self.ledger.tx() as c:
                self.ledger.add_quarantine(c, **row)
        log.warning("record_quarantined", source=src.name, file=file, line=raw.line, reason=err.reason, detail=detail)


def pull(
    sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, run_id: str, quarantine: Quarantine,
    max_seq_length: int, overlong: OverlongPolicy,
    special_tokens: SpecialTokens = "escape", excerpt_bytes: int = 16384, token_cache: TokenCache | None = None,
    workers: int | None = None,
) -> PullResult:
    """`token_cache`: where the ids of accepted samples are kept for the night's load; `workers`: processes
    that check the records of a large file (default: one less than the CPUs, at most 8; 0: none)."""
    p = _Pull(ledger, tokenizer, run_id, quarantine, max_seq_length, overlong, special_tokens, PullResult(),
              token_cache, default_workers() if workers is None else workers)
    try:
        for src in sources:
            _pull_source(p, src, excerpt_bytes)
    finally:
        try:
            quarantine.close()
        finally:
            if p.pool is not None:
                p.pool.close()
            close_early()
    return p.result


def _pull_source(p: _Pull, src: SourceConfig, excerpt_bytes: int) -> None:
    try:
        listing = list_inbox(src, now=p.ledger.clock())
    except OSError as e:  # the inbox itself: the other sources go on
        p.reject(None, src, printable(Path(src.inbox)), RawRecord(None, None),
                 RecordError("unreadable", f"inbox cannot be listed: {e.strerror or e}"))
        return
    for file, reason, detail in listing.refused:
        p.reject(None, src, file, RawRecord(None, None), RecordError(reason, detail))
    if listing.unmatched:
        p.result.unmatched += len(listing.unmatched)
        log.warning("files_not_matching_patterns", source=src.name, count=len(listing.unmatched),
                    examples=listing.unmatched[:5], patterns=src.patterns)
    allowed = roots(src)
    for f in listing.files:
        try:
            _ingest_file(p, src, f, allowed, excerpt_bytes)
        except sqlite3.Error:
            raise  # the ledger itself (a full disk, a lock): not this file's fault
        except (OSError, _Retry) as e:  # vanished, unreadable, swapped, changed while read: next pull
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            p.reject(None, src, f.display, RawRecord(None, None),
                     RecordError("unreadable", f"not read this time ({why}); tried again at the next pull"))
        except Exception as e:  # a bug or an input nobody foresaw: reported, the other files go on
            p.reject(None, src, f.display, RawRecord(None, None),
                     RecordError("internal_error", f"{type(e).__name__}: {printable(str(e), 200)}"))


def file_sha256(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    f.seek(0)
    return h.hexdigest()


def _ingest_file(p: _Pull, src: SourceConfig, f: InboxFile, allowed: list[Path], excerpt_bytes: int) -> None:
    ledger, result = p.ledger, p.result
    with open_inbox_file(f, allowed) as fh:
        st = os.fstat(fh.fileno())
        key = stat_key(st)
        if ledger.file_known_by_stat(src.name, f.display, key):
            return
        digest = file_sha256(fh)
        if ledger.file_known_by_hash(src.name, digest):
            ledger.remember_stat_key(src.name, f.display, digest, key)  # not hashed again while unchanged
            log.info("file_already_ingested", source=src.name, file=f.display, sha256=digest[:12])
            return
        counts, reasons = Counter[str](), Counter[str]()
        started, waited = time.monotonic(), [0.0]
        with ledger.tx() as conn:
            file_id = ledger.record_file(conn, source=src.name, path=f.display, size=st.st_size, mtime=st.st_mtime,
                                         sha256=digest, run_id=p.run_id, stat_key=key)
            chunks, checked_ahead = p.checked(src, f, fh, key, st.st_size, src.limits(excerpt_bytes))
            for checked in _timed(chunks, waited):
                kept = []
                for c in checked:
                    counts["records"] += 1
                    outcome, reason = _store(p, conn, src, f.display, file_id, c)
                    counts[outcome] += 1
                    if reason:
                        reasons[reason] += 1
                    elif outcome == "accepted" and isinstance(c, Stored):
                        kept.append((c.hash, c.ids, c.labels, c.reply))
                if p.token_cache is not None and kept:
                    p.token_cache.put_encoded(kept)
            after = os.fstat(fh.fileno())
            if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise _Retry("it changed while it was read")
            ledger.finish_file(conn, file_id, records=counts["records"], accepted=counts["accepted"],
                               duplicates=counts["duplicates"], quarantined=counts["quarantined"])
            p.quarantine.sync()  # durable before the ledger says the file was seen
    result.files += 1  # counted once the file's transaction committed
    result.ingested[src.name] += counts["accepted"]
    result.duplicates += counts["duplicates"]
    result.quarantined.update(reasons)
    # where a file's seconds went: reading and checking (by the workers: waiting for them), the rest is the
    # ledger, the quarantine and the token cache, written here
    log.info("file_ingested", source=src.name, file=f.display, **counts, seconds=round(time.monotonic() - started, 2),
             check_seconds=round(waited[0], 2), workers=_workers_used(p, st.st_size), checked_ahead=checked_ahead)
    if src.move_processed:
        _move_processed(ledger, src, f, file_id, digest)


def _workers_used(p: _Pull, size: int) -> int:
    """The workers that checked a file of `size` bytes (0: this process; also when the pool broke)."""
    pooled = p.workers > 0 and size >= PARALLEL_MIN_BYTES and p.pool is not None and p.pool.pool is not None
    return p.workers if pooled else 0


def _timed(it: Iterator[list[Checked | Stored]], waited: list[float]) -> Iterator[list[Checked | Stored]]:
    """The chunks of `it`, with the seconds spent getting each added to waited[0]."""
    while True:
        t = time.monotonic()
        chunk = next(it, None)
        waited[0] += time.monotonic() - t
        if chunk is None:
            return
        yield chunk


def _store(p: _Pull, conn: sqlite3.Connection, src: SourceConfig, file: str, file_id: int,
           c: Checked | Stored) -> tuple[str, str | None]:
    """One checked record into the ledger, inside its own guard: ('accepted' | 'duplicates' | 'quarantined', reason)."""
    if isinstance(c, Checked):  # refused where it was checked
        err = c.error or RecordError("internal_error", "checked without a result")
        p.reject(conn, src, file, c.raw, err)
        return "quarantined", err.reason
    try:
        new = p.ledger.add_sample(conn, hash=c.hash, source=src.name, file_id=file_id, line=c.line,
                                  record_json=c.record_json, n_tokens=c.n_tokens)
    except sqlite3.Error:
        raise  # the ledger (disk full, I/O): stops the pull, the file's transaction is rolled back
    except Exception as e:  # unforeseen (a record the database cannot take): kept aside, the file goes on
        err = RecordError("internal_error", f"{type(e).__name__}: {printable(str(e), 200)}")
        p.reject(conn, src, file, RawRecord(c.line, json.loads(c.record_json)), err)
        return "quarantined", err.reason
    return ("accepted" if new else "duplicates"), None


def _move_processed(ledger: Ledger, src: SourceConfig, f: InboxFile, file_id: int, digest: str) -> None:
    try:
        dest_dir = Path(src.inbox) / "processed"
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / f.path.name
        if dest.exists():
            dest = dest_dir / f"{f.path.stem}.{digest[:8]}{f.path.suffix}"
        shutil.move(str(f.path), dest)
        ledger.set_file_moved(file_id, printable(dest))
    except OSError as e:  # ingested all the same; known by its hash at the next pull
        log.warning("move_processed_failed", file=f.display, error=e.strerror or str(e))
