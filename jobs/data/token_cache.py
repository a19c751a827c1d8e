"""Token ids of the ledger's samples, kept from pull for the night's load (a cache, never the truth).

Why: pull tokenises every new record (it needs its length for the plan) and the night's load
tokenised the same records again (60,000 records: seconds of the wake on the CPU). Pull writes
the ids and labels here by the sample's content hash; the load reads them back and tokenises only
what is missing. One SQLite file per tokenizer identity (its files, chat template, max_seq_length
and overlong policy), so a changed tokenizer or limit never reads stale ids. Anything wrong with
the file (corrupt, unreadable) only costs a re-tokenisation: the ledger holds the records.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
from array import array
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import structlog

from jobs.contract.crashpoints import declare, reached
from jobs.data.batching import TokenizedSample
from jobs.data.formats import RecordError
from jobs.data.render import OverlongPolicy, SpecialTokens, tokenize_records
from jobs.runtime.gc_pause import collector_paused

log = structlog.get_logger("nightshift.data")
COMMITTED = declare("token_cache.committed", "a chunk of token ids is committed to the cache")


def tokenizer_identity(tokenizer: Any, max_seq_length: int, overlong: str, special_tokens: str = "escape") -> str:
    """What the ids depend on: the tokenizer's content (not where it was loaded from: the night's
    loader may read it from the cached 4-bit base), its chat template, special tokens and limits."""
    h = hashlib.sha256(f"{type(tokenizer).__name__}|{max_seq_length}|{overlong}|{special_tokens}|v2|".encode())
    for attr in ("chat_template", "eos_token", "bos_token"):
        h.update(f"|{getattr(tokenizer, attr, None)}".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    return h.hexdigest()[:16]


def encode(s: TokenizedSample) -> tuple[bytes, bytes, bytes | None]:
    """A sample's ids, labels and reply mask as the cache stores them."""
    return (array("i", s.input_ids).tobytes(), array("i", s.labels).tobytes(),
            None if s.reply_mask is None else bytes(map(int, s.reply_mask)))


class TokenCache:
    def __init__(self, root: Path, tokenizer: Any, *, max_seq_length: int, overlong: OverlongPolicy,
                 special_tokens: SpecialTokens = "escape") -> None:
        self.tokenizer, self.max_seq_length, self.overlong = tokenizer, max_seq_length, overlong
        self.special_tokens = special_tokens
        self.path = Path(root) / f"{tokenizer_identity(tokenizer, max_seq_length, overlong, special_tokens)}.sqlite"
        self.db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS tokens (hash TEXT PRIMARY KEY, ids BLOB NOT NULL, "
                            "labels BLOB NOT NULL, reply BLOB)")
        except sqlite3.Error as e:
            self._broken(e)

    def _broken(self, e: Exception) -> None:
        log.warning("token_cache_unavailable", path=str(self.path), error=str(e))
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
        self.db = None

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    def put(self, items: Iterable[tuple[str, TokenizedSample]]) -> None:
        self.put_encoded((h, *encode(s)) for h, s in items)

    def put_encoded(self, items: Iterable[tuple[str, bytes, bytes, bytes | None]]) -> None:
        """(hash, ids, labels, reply) rows as `encode` made them (a pull worker makes them for its records)."""
        if self.db is None:
            return
        rows = list(items)
        try:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO tokens (hash, ids, labels, reply) VALUES (?,?,?,?)", rows)
            self.db.execute("COMMIT")
            reached(COMMITTED)
        except sqlite3.Error as e:
            self._broken(e)

    def _get(self, hashes: Sequence[str]) -> dict[str, tuple[list[int], list[int], list[bool] | None]]:
        out: dict[str, tuple[list[int], list[int], list[bool] | None]] = {}
        if self.db is None:
            return out
        try:
            for i in range(0, len(hashes), 500):
                chunk = list(hashes[i : i + 500])
                q = f"SELECT hash, ids, labels, reply FROM tokens WHERE hash IN ({','.join('?' * len(chunk))})"
                for h, ids, labels, reply in self.db.execute(q, chunk):
                    out[h] = (array("i", ids).tolist(), array("i", labels).tolist(),
                              None if reply is None else list(map(bool, reply)))
        except sqlite3.Error as e:
            self._broken(e)
            return {}
        return out

    def samples(self, keys: Sequence[tuple[int, str]],
                records: Callable[[list[int]], Sequence[Any]]) -> list[TokenizedSample]:
        """(sample id, content hash) pairs as TokenizedSamples, in order: cached ids where there are any; the
        rest read through `records` (the ledger's SampleRows of those ids: only a miss parses its record)
        and tokenised in one batch (and cached). A record that no longer tokenises (it did at pull) raises
        its RecordError, as the unbatched path did."""
        with collector_paused():  # ~180k lists and 60,000 samples for 60,000 records: jobs/runtime/gc_pause.py
            hit = self._get([h for _, h in keys])
            missing = [(sid, h) for sid, h in keys if h not in hit]
            fresh: dict[str, TokenizedSample] = {}
            if missing:
                rows = records([sid for sid, _ in missing])
                done = tokenize_records(self.tokenizer, [(r.id, r.record) for r in rows],
                                        max_seq_length=self.max_seq_length, overlong=self.overlong,
                                        special_tokens=self.special_tokens)
                for r, s in zip(rows, done, strict=True):
                    if isinstance(s, RecordError):
                        raise s
                    fresh[r.hash] = s
                self.put(fresh.items())
            log.info("tokens_loaded", samples=len(keys), cached=len(keys) - len(missing), tokenised=len(missing))
            return [fresh[h] if h in fresh else TokenizedSample(sid, *hit[h]) for sid, h in keys]
