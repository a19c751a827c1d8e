"""Pull: take every new inbox file into the ledger exactly once.

A file is new when the ledger has neither its (path, size, mtime) nor its sha256.
Each file is ingested in one transaction (file row, samples, quarantine rows), so a
crash mid-file leaves nothing of it recorded and the next run reads it again.
Invalid records go to the run's quarantine file with the original record (or bytes),
file, line and reason; the run goes on with the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from jobs.data.batching import TokenizedSample
from jobs.data.formats import Normalised, RecordError, normalise
from jobs.data.render import OverlongPolicy, tokenize_record
from jobs.data.sources import RawRecord, SourceConfig, new_files, read_records
from jobs.store.files import sha256_file
from jobs.store.ledger import Ledger, SampleRow

log = structlog.get_logger("nightshift.pull")


@dataclass
class PullResult:
    files: int = 0
    ingested: Counter[str] = field(default_factory=Counter)  # source -> new samples
    duplicates: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)  # reason -> records
    incoming: list[SampleRow] = field(default_factory=list)  # preview only: what would become pending


class Quarantine:
    """Append-only JSONL of rejected records, one file per run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, *, source: str, file: Path, line: int | None, reason: str, detail: str,
            record: Any = None, raw: str | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"source": source, "file": str(file), "line": line, "reason": reason, "detail": detail}
        if record is not None:
            entry["record"] = record
        if raw is not None:
            entry["raw"] = raw
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


@dataclass(frozen=True)
class Checked:
    """One record read as the inbox reads it: its normal form and tokens, or why it is refused."""

    raw: RawRecord
    norm: Normalised | None = None
    tokens: TokenizedSample | None = None
    error: RecordError | None = None


def checked_records(path: Path, src: SourceConfig, tokenizer: Any, *, max_seq_length: int,
                    overlong: OverlongPolicy, cache_dir: Path) -> Iterator[Checked]:
    """Every record of a file, decoded, normalised with the source's format and field map and
    rendered through the chat template: the one reading shared by pull, plan and validate."""
    for raw in read_records(path, cache_dir):
        if raw.error is not None:
            yield Checked(raw, error=raw.error)
            continue
        try:
            norm = normalise(raw.record, src.format, src.field_map)
            tokens = tokenize_record(tokenizer, 0, norm.record, max_seq_length=max_seq_length, overlong=overlong)
        except RecordError as e:
            yield Checked(raw, error=e)
            continue
        yield Checked(raw, norm, tokens)


def _unseen_files(src: SourceConfig, ledger: Ledger) -> Iterator[tuple[Path, os.stat_result, str]]:
    """(path, stat, sha256) of the inbox files the ledger has not ingested yet."""
    for path in new_files(src, now=ledger.clock()):
        st = path.stat()
        if ledger.file_known_by_stat(src.name, str(path), st.st_size, st.st_mtime):
            continue
        digest = sha256_file(path)
        if ledger.file_known_by_hash(src.name, digest):
            log.info("file_already_ingested", source=src.name, file=str(path), sha256=digest[:12])
            continue
        yield path, st, digest


def preview(sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, max_seq_length: int,
            overlong: OverlongPolicy, cache_dir: Path) -> PullResult:
    """What a pull would add, changing nothing (`nightshift plan`): the counts, and in `incoming` the
    new samples as rows with negative ids (-1, -2, ... in reading order), to plan after the pending ones."""
    result, seen_files, seen = PullResult(), set[tuple[str, str]](), set[str]()
    rows = result.incoming
    for src in sources:
        for path, _st, digest in _unseen_files(src, ledger):
            if (src.name, digest) in seen_files:
                continue
            seen_files.add((src.name, digest))
            result.files += 1
            for c in checked_records(path, src, tokenizer, max_seq_length=max_seq_length, overlong=overlong,
                                     cache_dir=cache_dir):
                if c.error is not None:
                    result.quarantined[c.error.reason] += 1
                elif c.norm is not None and c.tokens is not None:
                    if c.norm.hash in seen or ledger.has_sample(c.norm.hash):
                        result.duplicates += 1
                        continue
                    seen.add(c.norm.hash)
                    rows.append(SampleRow(-len(rows) - 1, c.norm.hash, {}, c.tokens.n_tokens, src.name))
                    result.ingested[src.name] += 1
    return result


def pull(
    sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, run_id: str, quarantine: Quarantine,
    max_seq_length: int, overlong: OverlongPolicy, cache_dir: Path,
) -> PullResult:
    result = PullResult()
    for src in sources:
        for path, st, digest in _unseen_files(src, ledger):
            _ingest_file(src, path, st, digest, ledger, tokenizer, run_id, quarantine,
                         max_seq_length, overlong, cache_dir, result)
    return result


def _ingest_file(src: SourceConfig, path: Path, st: os.stat_result, digest: str, ledger: Ledger,
                 tokenizer: Any, run_id: str, quarantine: Quarantine, max_seq_length: int,
                 overlong: OverlongPolicy, cache_dir: Path, result: PullResult) -> None:
    counts = Counter[str]()
    with ledger.tx() as conn:
        file_id = ledger.record_file(conn, source=src.name, path=str(path), size=st.st_size,
                                     mtime=st.st_mtime, sha256=digest, run_id=run_id)
        for c in checked_records(path, src, tokenizer, max_seq_length=max_seq_length, overlong=overlong,
                                 cache_dir=cache_dir):
            raw, err, norm, tokens = c.raw, c.error, c.norm, c.tokens
            counts["records"] += 1
            if err is not None:
                counts["quarantined"] += 1
                result.quarantined[err.reason] += 1
                quarantine.add(source=src.name, file=path, line=raw.line, reason=err.reason,
                               detail=err.detail, record=raw.record, raw=raw.raw)
                ledger.add_quarantine(conn, run_id=run_id, source=src.name, file=str(path), line=raw.line,
                                      reason=err.reason, detail=err.detail)
                log.warning("record_quarantined", source=src.name, file=str(path), line=raw.line,
                            reason=err.reason, detail=err.detail)
                continue
            assert norm is not None and tokens is not None
            if ledger.add_sample(conn, hash=norm.hash, source=src.name, file_id=file_id, line=raw.line or 0,
                                 record=norm.record, n_tokens=tokens.n_tokens):
                counts["accepted"] += 1
                result.ingested[src.name] += 1
            else:
                counts["duplicates"] += 1
                result.duplicates += 1
        ledger.finish_file(conn, file_id, records=counts["records"], accepted=counts["accepted"],
                           duplicates=counts["duplicates"], quarantined=counts["quarantined"])
    result.files += 1
    log.info("file_ingested", source=src.name, file=str(path), **counts)
    if src.move_processed:
        dest_dir = Path(src.inbox) / "processed"
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / path.name
        if dest.exists():
            dest = dest_dir / f"{path.stem}.{digest[:8]}{path.suffix}"
        shutil.move(str(path), dest)
        ledger.set_file_moved(file_id, str(dest))
