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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from jobs.data.formats import RecordError, normalise
from jobs.data.render import OverlongPolicy, tokenize_records
from jobs.data.sources import SourceConfig, new_files, read_records
from jobs.data.token_cache import TokenCache
from jobs.store.files import sha256_file
from jobs.store.ledger import Ledger

log = structlog.get_logger("nightshift.pull")


@dataclass
class PullResult:
    files: int = 0
    ingested: Counter[str] = field(default_factory=Counter)  # source -> new samples
    duplicates: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)  # reason -> records


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


def pull(
    sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, run_id: str, quarantine: Quarantine,
    max_seq_length: int, overlong: OverlongPolicy, cache_dir: Path, token_cache: TokenCache | None = None,
) -> PullResult:
    """`token_cache`: where the ids of accepted samples are kept for the night's load."""
    result = PullResult()
    for src in sources:
        for path in new_files(src, now=ledger.clock()):
            st = path.stat()
            if ledger.file_known_by_stat(src.name, str(path), st.st_size, st.st_mtime):
                continue
            digest = sha256_file(path)
            if ledger.file_known_by_hash(src.name, digest):
                log.info("file_already_ingested", source=src.name, file=str(path), sha256=digest[:12])
                continue
            _ingest_file(src, path, st, digest, ledger, tokenizer, run_id, quarantine,
                         max_seq_length, overlong, cache_dir, result, token_cache)
    return result


TOKENIZE_BATCH = 512  # records per call of the tokenizer (its batch encode)


def _ingest_file(src: SourceConfig, path: Path, st: os.stat_result, digest: str, ledger: Ledger,
                 tokenizer: Any, run_id: str, quarantine: Quarantine, max_seq_length: int,
                 overlong: OverlongPolicy, cache_dir: Path, result: PullResult,
                 token_cache: TokenCache | None = None) -> None:
    counts = Counter[str]()
    with ledger.tx() as conn:
        file_id = ledger.record_file(conn, source=src.name, path=str(path), size=st.st_size,
                                     mtime=st.st_mtime, sha256=digest, run_id=run_id)

        def reject(raw: Any, err: RecordError) -> None:
            counts["quarantined"] += 1
            result.quarantined[err.reason] += 1
            quarantine.add(source=src.name, file=path, line=raw.line, reason=err.reason,
                           detail=err.detail, record=raw.record, raw=raw.raw)
            ledger.add_quarantine(conn, run_id=run_id, source=src.name, file=str(path), line=raw.line,
                                  reason=err.reason, detail=err.detail)
            log.warning("record_quarantined", source=src.name, file=str(path), line=raw.line,
                        reason=err.reason, detail=err.detail)

        def flush(batch: list[tuple[Any, Any]]) -> None:
            toks = tokenize_records(tokenizer, [(0, norm.record) for _, norm in batch],
                                    max_seq_length=max_seq_length, overlong=overlong)
            kept = []
            for (raw, norm), tokens in zip(batch, toks, strict=True):
                if isinstance(tokens, RecordError):
                    reject(raw, tokens)
                elif ledger.add_sample(conn, hash=norm.hash, source=src.name, file_id=file_id, line=raw.line or 0,
                                       record=norm.record, n_tokens=tokens.n_tokens):
                    counts["accepted"] += 1
                    result.ingested[src.name] += 1
                    kept.append((norm.hash, tokens))
                else:
                    counts["duplicates"] += 1
                    result.duplicates += 1
            if token_cache is not None and kept:
                token_cache.put(kept)
            batch.clear()

        pending: list[tuple[Any, Any]] = []
        for raw in read_records(path, cache_dir):
            counts["records"] += 1
            if raw.error is not None:
                reject(raw, raw.error)
                continue
            try:
                pending.append((raw, normalise(raw.record, src.format, src.field_map)))
            except RecordError as e:
                reject(raw, e)
            if len(pending) >= TOKENIZE_BATCH:
                flush(pending)
        flush(pending)
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
