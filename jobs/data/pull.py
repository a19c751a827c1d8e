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

A stop request (SIGTERM) ends the pull between two chunks of records: the file being read is rolled
back (read again at the next pull), every file committed before it is kept.

`move_processed`: a producer may still hold a moved file open and append to it. So a moved file stays
watched: its stat key (with the size and mtime that were read) is kept, and a file in `processed/` whose
key changed is read again (its known records count as duplicates, the appended ones are ingested).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from jobs.contract import QuarantineReason
from jobs.contract.crashpoints import declare, reached
from jobs.data.check import Checked, Stored, check_for_store
from jobs.data.formats import RecordError
from jobs.data.inbox import BELOW_THE_INBOX, InboxFile, list_inbox, open_inbox_file, printable, roots, stat_key
from jobs.data.parallel import (
    PARALLEL_MIN_BYTES,
    TOKENIZE_BATCH,
    CheckPool,
    check_options,
    chunked,
    default_workers,
    pool_for,
    pull_done,
)
from jobs.data.prefetch import take
from jobs.data.quarantine import Quarantine
from jobs.data.readers import Limits, RawRecord
from jobs.data.render import OverlongPolicy, SpecialTokens
from jobs.data.sources import SourceConfig, read_stream
from jobs.data.token_cache import TokenCache
from jobs.store.ledger import Ledger, SampleRow

__all__ = ["PullResult", "Quarantine", "pull"]
log = structlog.get_logger("nightshift.pull")

KEPT_PER_FILE = 10_000  # quarantined records of one file kept one by one (quarantine file, ledger); the rest counted
LOGGED_PER_FILE = 20  # of them, logged one by one (the rest: one line)
FILE_COMMITTING = declare("pull.file_committing", "a file's records are in its transaction, not committed yet")
FILE_COMMITTED = declare("pull.file_committed", "a file's transaction committed (its samples are pending)")
FILE_MOVING = declare("pull.file_moving", "the ledger says where the file goes; it is not moved yet")
FILE_MOVED = declare("pull.file_moved", "the file is in processed/; its watched stat key not stored yet")


@dataclass
class PullResult:
    files: int = 0
    ingested: Counter[str] = field(default_factory=Counter)  # source -> new samples
    duplicates: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)  # reason -> records
    unmatched: int = 0  # inbox files matching no pattern (reported, not read)
    incoming: list[SampleRow] = field(default_factory=list)  # preview only: what would become pending
    stopped: bool = False  # a stop request ended the pull early (what was committed is kept)


class _Retry(Exception):
    """Not read this time (changed while read): the next pull reads it."""


class _Stopped(Exception):
    """A stop request: the file being read is rolled back, the pull ends."""


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
    stop: threading.Event | None = None  # set by SIGTERM: the pull ends between two chunks
    in_file: int = 0  # records of the file being read quarantined so far
    beyond: Counter[str] = field(default_factory=Counter)  # by reason, those past KEPT_PER_FILE

    def check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise _Stopped

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
        """Quarantine (file and ledger); counted here for a whole file, by the file's own tally for records. A file's
        records past KEPT_PER_FILE are counted by reason only, past LOGGED_PER_FILE not logged (`flooded`)."""
        if conn is None:
            self.result.quarantined[err.reason] += 1
        else:
            self.in_file += 1
            if self.in_file > KEPT_PER_FILE:
                self.beyond[err.reason] += 1
                return
        self.quarantine.add(source=src.name, file=file, line=raw.line, item=raw.item, reason=err.reason,
                            detail=err.detail, record=raw.record, raw=raw.raw, size=raw.size, sha256=raw.sha256)
        detail = printable(err.detail, 500)
        row = {"run_id": self.run_id, "source": src.name, "file": file, "line": raw.line, "reason": err.reason,
               "detail": detail}
        if conn is not None:
            self.ledger.add_quarantine(conn, **row)
        else:
            with self.ledger.tx() as c:
                self.ledger.add_quarantine(c, **row)
        if err.reason == QuarantineReason.unreadable:  # left in place and retried: not called quarantined
            log.warning("file_not_read", source=src.name, file=file, detail=detail)
        elif conn is None or self.in_file <= LOGGED_PER_FILE:
            log.warning("record_quarantined", source=src.name, file=file, line=raw.line, item=raw.item,
                        reason=err.reason, detail=detail)

    def flooded(self, conn: sqlite3.Connection, src: SourceConfig, file: str) -> None:
        """The end of a file with more quarantined records than are kept or logged one by one: one entry for the
        rest. (200,000 bad lines of 2 bytes each made a 36 MB quarantine, 31 MB of ledger and 67 MB of log.)"""
        if self.in_file > LOGGED_PER_FILE:
            log.warning("records_quarantined_not_logged", source=src.name, file=file,
                        count=self.in_file - LOGGED_PER_FILE, detail="the quarantine file lists them")
        if not self.beyond:
            return
        n, (reason, _) = sum(self.beyond.values()), self.beyond.most_common(1)[0]
        why = ", ".join(f"{k} {v:,}" for k, v in sorted(self.beyond.items()))
        detail = f"{n:,} more records of this file quarantined ({why}), not listed one by one: the first " \
                 f"{KEPT_PER_FILE:,} are"
        self.quarantine.add(source=src.name, file=file, line=None, reason=reason, detail=detail)
        self.ledger.add_quarantine(conn, run_id=self.run_id, source=src.name, file=file, line=None, reason=reason,
                                   detail=detail)


def pull(
    sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, run_id: str, quarantine: Quarantine,
    max_seq_length: int, overlong: OverlongPolicy,
    special_tokens: SpecialTokens = "escape", excerpt_bytes: int = 16384, token_cache: TokenCache | None = None,
    workers: int | None = None, stop: threading.Event | None = None,
) -> PullResult:
    """`token_cache`: where the ids of accepted samples are kept for the night's load; `workers`: processes
    that check the records of a large file (default: one less than the CPUs, at most 8; 0: none);
    `stop`: when set, the pull ends within one chunk of records (result.stopped)."""
    p = _Pull(ledger, tokenizer, run_id, quarantine, max_seq_length, overlong, special_tokens, PullResult(),
              token_cache, default_workers() if workers is None else workers, stop=stop)
    try:
        for src in sources:
            _pull_source(p, src, excerpt_bytes)
    except _Stopped:
        p.result.stopped = True
        log.info("pull_stopped", files=p.result.files, ingested=sum(p.result.ingested.values()))
    finally:
        try:
            quarantine.close()
        finally:
            pull_done(p.pool)  # kept where it checked another adapter's files ahead
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
    if listing.directories:
        log.warning("directories_not_read", source=src.name, count=len(listing.directories),
                    examples=listing.directories[:5],
                    detail=f"an inbox reads files, not directories ({BELOW_THE_INBOX})")
    allowed = roots(src)
    for f in [*listing.files, *(_grown_moved(p, src) if src.move_processed else [])]:
        p.check_stop()
        try:
            _ingest_file(p, src, f, allowed, excerpt_bytes)
        except (sqlite3.Error, _Stopped):
            raise  # the ledger itself (a full disk, a lock): not this file's fault; or a stop request
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
            _move_known(ledger, src, f, st)
            return
        digest = file_sha256(fh)
        if ledger.file_known_by_hash(src.name, digest):
            ledger.remember_stat_key(src.name, f.display, digest, key)  # not hashed again while unchanged
            log.info("file_already_ingested", source=src.name, file=f.display, sha256=digest[:12])
            if _in_processed(src, f):  # a moved file seen again unchanged in content: watched under its new key
                ledger.refresh_moved(src.name, f.display, key)
            _move_known(ledger, src, f, st)
            return
        counts, reasons = Counter[str](), Counter[str]()
        p.in_file, p.beyond = 0, Counter()
        started, waited = time.monotonic(), [0.0]
        with ledger.tx() as conn:
            file_id = ledger.record_file(conn, source=src.name, path=f.display, size=st.st_size, mtime=st.st_mtime,
                                         sha256=digest, run_id=p.run_id, stat_key=key)
            chunks, checked_ahead = p.checked(src, f, fh, key, st.st_size, src.limits(excerpt_bytes))
            for checked in _timed(chunks, waited):
                p.check_stop()  # rolls this file back: read again at the next pull
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
            if stat_key(os.fstat(fh.fileno())) != key:  # its ctime too: a rewrite that set its mtime back
                raise _Retry("it changed while it was read")
            p.flooded(conn, src, f.display)
            ledger.finish_file(conn, file_id, records=counts["records"], accepted=counts["accepted"],
                               duplicates=counts["duplicates"], quarantined=counts["quarantined"])
            p.quarantine.sync()  # durable before the ledger says the file was seen
            reached(FILE_COMMITTING)
    reached(FILE_COMMITTED)
    result.files += 1  # counted once the file's transaction committed
    result.ingested[src.name] += counts["accepted"]
    result.duplicates += counts["duplicates"]
    result.quarantined.update(reasons)
    # where a file's seconds went: reading and checking (by the workers: waiting for them), the rest is the
    # ledger, the quarantine and the token cache, written here
    log.info("file_ingested", source=src.name, file=f.display, **counts, seconds=round(time.monotonic() - started, 2),
             check_seconds=round(waited[0], 2), workers=_workers_used(p, st.st_size), checked_ahead=checked_ahead)
    if _in_processed(src, f):  # a moved file that grew: watched again under its new key
        ledger.set_file_moved(file_id, f.display, key)
    elif src.move_processed:
        _move_processed(ledger, src, f, file_id, digest, st)


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


def _processed_dir(src: SourceConfig) -> Path:
    return Path(src.inbox) / "processed"


def _in_processed(src: SourceConfig, f: InboxFile) -> bool:
    return f.path.parent == _processed_dir(src)


def _grown_moved(p: _Pull, src: SourceConfig) -> list[InboxFile]:
    """Moved files whose stat key changed since they were read (a producer appended to them): read again.
    One stat per moved file and pull; a file removed from processed/ by the operator is simply not there."""
    out = []
    now = p.ledger.clock()
    for moved, key in p.ledger.moved_files(src.name):
        path = Path(moved)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or stat_key(st) == key or now - st.st_mtime < src.settle_seconds:
            continue
        log.info("moved_file_grew", source=src.name, file=moved)
        out.append(InboxFile(path, path, moved, st.st_mtime))
    return out


def _move_known(ledger: Ledger, src: SourceConfig, f: InboxFile, st: os.stat_result) -> None:
    """A file already ingested but still in the inbox (a crash before its move, a move that failed): moved now."""
    if not src.move_processed or _in_processed(src, f):
        return
    row = ledger.file_by_stat(src.name, f.display, stat_key(st))
    if row is not None:
        _move_processed(ledger, src, f, row, "", st)


def _move_processed(ledger: Ledger, src: SourceConfig, f: InboxFile, file_id: int, digest: str,
                    read: os.stat_result) -> None:
    """Into processed/, then watched there: the key stored is the moved file's identity with the size and mtime
    that were read, so bytes appended after the read (before or after the move) make it differ."""
    try:
        dest_dir = _processed_dir(src)
        with contextlib.suppress(FileExistsError):
            os.mkdir(dest_dir)
        try:  # processed/ itself, never where a link in its place points (a producer could aim the moves anywhere)
            fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise OSError(f"{printable(dest_dir)} is not a directory of the inbox (a symbolic link?): files are left "
                          f"where they are ({e.strerror or e})") from None
        try:
            name = f.path.name
            with contextlib.suppress(FileNotFoundError):
                os.stat(name, dir_fd=fd, follow_symlinks=False)
                name = f"{f.path.stem}.{(digest or str(file_id))[:8]}{f.path.suffix}"
            dest = dest_dir / name
            ledger.set_file_moved(file_id, printable(dest), None)  # watched from now on, whatever happens next
            reached(FILE_MOVING)
            os.rename(f.path, name, dst_dir_fd=fd)
            reached(FILE_MOVED)
            now = os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        key = f"{now.st_dev}:{now.st_ino}:{read.st_size}:{read.st_mtime_ns}:{now.st_ctime_ns}"
        ledger.set_file_moved(file_id, printable(dest), key)
    except OSError as e:  # ingested all the same; known by its hash at the next pull
        log.warning("move_processed_failed", file=f.display, error=e.strerror or str(e))
