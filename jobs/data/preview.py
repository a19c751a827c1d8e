"""What a pull would add, changing nothing (`nightshift plan`): the same listing, identity and reading
as the pull (jobs/data/pull.py), over a ledger opened read-only; no file is moved or quarantined."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog

from jobs.data.check import check_record
from jobs.data.inbox import list_inbox, open_inbox_file, roots, stat_key
from jobs.data.pull import PullResult, file_sha256
from jobs.data.render import OverlongPolicy, SpecialTokens
from jobs.data.sources import SourceConfig, read_stream
from jobs.store.ledger import Ledger, SampleRow

log = structlog.get_logger("nightshift.pull")
UNREADABLE = "unreadable"  # a file or inbox not read this time: retried at the next pull, never quarantined


def preview(sources: list[SourceConfig], ledger: Ledger, tokenizer: Any, *, max_seq_length: int,
            overlong: OverlongPolicy, special_tokens: SpecialTokens = "escape",
            excerpt_bytes: int = 16384) -> PullResult:
    """The counts, and in `incoming` the new samples as rows with negative ids (-1, -2, ... in reading
    order), to plan after the pending ones."""
    result, seen_files, seen = PullResult(), set[tuple[str, str]](), set[str]()
    for src in sources:
        try:
            listing = list_inbox(src, now=ledger.clock())
        except OSError as e:
            log.warning("inbox_unreadable", source=src.name, error=e.strerror or str(e))
            result.quarantined[UNREADABLE] += 1  # shown by the plan as not readable now (the pull retries it)
            continue
        for _file, reason, _detail in listing.refused:  # as the pull counts them
            result.quarantined[reason] += 1
        result.unmatched += len(listing.unmatched)
        allowed = roots(src)
        for f in listing.files:
            try:
                with open_inbox_file(f, allowed) as fh:
                    if ledger.file_known_by_stat(src.name, f.display, stat_key(os.fstat(fh.fileno()))):
                        continue
                    digest = file_sha256(fh)
                    if ledger.file_known_by_hash(src.name, digest) or (src.name, digest) in seen_files:
                        continue
                    seen_files.add((src.name, digest))
                    result.files += 1
                    for raw in read_stream(fh, Path(f.path).suffix, src.limits(excerpt_bytes)):
                        c = check_record(raw, src, tokenizer, max_seq_length=max_seq_length, overlong=overlong,
                                         special_tokens=special_tokens)
                        if c.error is not None:
                            result.quarantined[c.error.reason] += 1
                        elif c.norm is not None and c.tokens is not None:
                            if c.norm.hash in seen or ledger.has_sample(c.norm.hash):
                                result.duplicates += 1
                                continue
                            seen.add(c.norm.hash)
                            result.incoming.append(SampleRow(-len(result.incoming) - 1, c.norm.hash, {},
                                                             c.tokens.n_tokens, src.name))
                            result.ingested[src.name] += 1
            except OSError as e:  # vanished or unreadable: shown in the plan; the pull retries it
                log.warning("file_not_previewed", source=src.name, file=f.display, error=e.strerror or str(e))
                result.quarantined[UNREADABLE] += 1
    return result
