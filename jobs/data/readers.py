"""Readers of inbox files that no input can stop: every record is decoded inside its own guard and
comes out as a RawRecord (the record, or the reason it cannot be one); nothing a file contains makes
a reader raise.

Memory per record is bounded: at most `max_record_bytes` of one record are held (a longer JSONL line,
JSON element or CSV record is skipped while it is read, keeping only an excerpt, its size and its
sha256), JSON arrays are split into elements by a streaming scanner and parsed one at a time, Parquet is
read batch by batch (CSV row by row: jobs/data/csv_rows.py; which reader reads a file: jobs/data/sources.py).
Nesting deeper than `max_depth`, numbers too long for Python to parse, invalid UTF-8 and a UTF-8 byte-order
mark are handled per record.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import IO, Any

from jobs.data.formats import RecordError

BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Limits:
    max_record_bytes: int = 1 << 20  # bytes of one record held in memory; a longer one is quarantined
    excerpt_bytes: int = 4096  # what the quarantine keeps of a record it cannot keep whole
    max_depth: int = 64  # nesting of arrays/objects in one record (a real record has 3 or 4)
    fields: frozenset[str] = frozenset()  # names a CSV header must hold one of (the source's); empty: any


@dataclass(frozen=True)
class RawRecord:
    line: int | None  # 1-based physical line where the record starts (JSONL, JSON, CSV) or row number
    # (Parquet); None = the whole file
    record: Any | None  # the decoded record, or None when it could not be decoded
    error: RecordError | None = None
    raw: str | None = None  # what to keep in quarantine when the record could not be decoded (an excerpt)
    size: int | None = None  # bytes of the record, when only an excerpt of it is kept
    sha256: str | None = None  # of the whole record, when only an excerpt of it is kept
    item: int | None = None  # 1-based element of a JSON array: several elements can share a line


_FOREIGN_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
                 (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)"))


def foreign_encoding(f: IO[bytes]) -> RawRecord | None:
    """A text file that starts with the byte-order mark of UTF-16 or UTF-32 (what some editors and Windows tools
    save as "Unicode"), refused whole with its name: read as UTF-8 each of its lines was a different error."""
    pos = f.tell()
    head = f.read(4)
    f.seek(pos)
    for bom, name in _FOREIGN_BOMS:
        if head.startswith(bom):
            return RawRecord(None, None, RecordError("bad_file", f"{name} text (it starts with the byte-order mark "
                                                     f"{bom.hex(' ').upper()}): the inbox reads UTF-8; convert it, "
                                                     f"e.g. iconv -f {name.split()[0]} -t UTF-8"))
    return None


def excerpt(data: bytes, limit: int) -> str:
    return data[:limit].decode("utf-8", "backslashreplace")


def depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded value, counted without recursion (stops once past `limit`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def decode_json(raw: bytes, line: int | None, lim: Limits) -> RawRecord:
    """One JSON value from bytes, every failure a reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRecord(line, None, RecordError("invalid_utf8", f"not UTF-8: {e}"), raw[: lim.excerpt_bytes].hex())
    try:
        rec = json.loads(text)
    except RecursionError:
        err = RecordError("too_large", "nested too deeply to parse")
    except json.JSONDecodeError as e:
        cr = "\r" in text[: e.pos] and e.msg == "Extra data"  # old Mac line ends: the whole file one line
        err = RecordError("invalid_json", f"invalid JSON: {e}" + (" (lines that end in a carriage return alone? JSON "
                                                                  "Lines needs \\n or \\r\\n)" if cr else ""))
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        err = RecordError("too_large", f"cannot parse: {e}")
    else:
        d = depth(rec, lim.max_depth)
        if d > lim.max_depth:
            return RawRecord(line, None, RecordError("too_large", f"nested more than {lim.max_depth} levels deep"),
                             excerpt(raw, lim.excerpt_bytes), len(raw), hashlib.sha256(raw).hexdigest())
        return RawRecord(line, rec)
    return RawRecord(line, None, err, excerpt(raw.rstrip(b"\r\n"), lim.excerpt_bytes))


def _too_large(line: int | None, head: bytes, size: int, digest: str, lim: Limits, what: str) -> RawRecord:
    return RawRecord(line, None, RecordError("too_large", f"{what} of {size:,} bytes > max_record_bytes "
                                             f"{lim.max_record_bytes:,} (skipped unread)"),
                     excerpt(head, lim.excerpt_bytes), size, digest)


# ---- JSONL ----------------------------------------------------------------------------------------


def read_jsonl(f: IO[bytes], lim: Limits, *, first_line: int = 1, stop: int | None = None) -> Iterator[RawRecord]:
    """From where `f` is: its line number `first_line` (only line 1 may start with a byte-order mark); `stop`:
    the lines that start before this offset (the one that starts before it is read whole), else to the end."""
    if first_line == 1 and (foreign := foreign_encoding(f)):
        yield foreign
        return
    n = first_line - 1
    while stop is None or f.tell() < stop:
        raw = f.readline(lim.max_record_bytes + 1)
        if not raw:
            return
        n += 1
        if n == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if len(raw) > lim.max_record_bytes and not raw.endswith(b"\n"):
            h, size, head = hashlib.sha256(raw), len(raw), raw
            while not raw.endswith(b"\n"):
                raw = f.readline(1 << 20)
                if not raw:
                    break
                h.update(raw)
                size += len(raw)
            yield _too_large(n, head, size, h.hexdigest(), lim, "a line")
            continue
        if raw.strip():
            yield decode_json(raw, n, lim)


# ---- JSON arrays, streamed ------------------------------------------------------------------------

_STRUCT = re.compile(rb'[\[\]{}",]')
_IN_STRING = re.compile(rb'["\\]')
_WS = b" \t\r\n"


class _Element:
    """The bytes of one array element, held up to the cap; beyond it only a head, a size and a hash."""

    def __init__(self, lim: Limits, line: int) -> None:
        self.lim, self.line = lim, line
        self.buf = bytearray()
        self.size = 0
        self.hash: Any = None
        self.deepest = 0

    def add(self, seg: bytes) -> None:
        self.size += len(seg)
        if self.hash is None and self.size > self.lim.max_record_bytes:
            self.hash = hashlib.sha256(self.buf)
            del self.buf[self.lim.excerpt_bytes:]
        if self.hash is not None:
            self.hash.update(seg)
            room = self.lim.excerpt_bytes - len(self.buf)
            if room > 0:
                self.buf += seg[:room]
        else:
            self.buf += seg

    def empty(self) -> bool:
        return self.hash is None and not bytes(self.buf).strip(_WS)

    def record(self, n: int) -> RawRecord:
        data = bytes(self.buf)
        line = self.line + data[: len(data) - len(data.lstrip(_WS))].count(b"\n")
        if self.hash is not None:
            return _too_large(line, data.lstrip(_WS), self.size, self.hash.hexdigest(), self.lim, f"record {n}")
        if self.deepest > self.lim.max_depth:
            return RawRecord(line, None, RecordError("too_large", f"nested more than {self.lim.max_depth} levels "
                                                     "deep"), excerpt(data.strip(_WS), self.lim.excerpt_bytes),
                             self.size, hashlib.sha256(data).hexdigest())
        return decode_json(data, line, self.lim)


def read_json_array(f: IO[bytes], lim: Limits) -> Iterator[RawRecord]:
    """The elements of a top-level JSON array, one at a time (the file is never held whole)."""
    if foreign := foreign_encoding(f):
        yield foreign
        return
    chunk = f.read(1 << 16)
    if chunk.startswith(BOM):
        chunk = chunk[len(BOM):]
    lines = 1
    while chunk and not chunk.strip(_WS):
        lines += chunk.count(b"\n")
        chunk = f.read(1 << 16)
    if not chunk:
        yield RawRecord(None, None, RecordError("invalid_json", "the file holds no JSON (empty)"))
        return
    start = len(chunk) - len(chunk.lstrip(_WS))
    lines += chunk.count(b"\n", 0, start)
    if chunk[start:start + 1] != b"[":
        got = ("an object (one record a line is JSON Lines: name the file .jsonl)" if chunk[start:start + 1] == b"{"
               else f"{chunk[start:start + 12]!r}")
        yield RawRecord(None, None, RecordError("bad_file", f"a .json file must hold an array of records, got {got}"))
        return
    depth_, in_str, esc, n = 1, False, False, 0
    pos, seg = start + 1, start + 1
    counted = seg  # newlines counted up to here in this chunk
    elem = _Element(lim, lines)
    while True:
        while pos < len(chunk):
            if esc:
                esc, pos = False, pos + 1
                continue
            if in_str:
                m = _IN_STRING.search(chunk, pos)
                if m is None:
                    pos = len(chunk)
                elif m.group() == b"\\":
                    esc, pos = True, m.end()
                else:
                    in_str, pos = False, m.end()
                continue
            m = _STRUCT.search(chunk, pos)
            if m is None:
                pos = len(chunk)
                continue
            c, pos = m.group(), m.end()
            if c == b'"':
                in_str = True
            elif c in b"[{":
                depth_ += 1
                elem.deepest = max(elem.deepest, depth_ - 1)
            elif c in b"]}" and depth_ > 1:
                depth_ -= 1
            elif (c == b"," and depth_ == 1) or c in b"]}":  # the end of an element (or of the array)
                elem.add(chunk[seg:pos - 1])
                lines += chunk.count(b"\n", counted, pos)
                counted = seg = pos
                end_of_array = c != b","
                if not (end_of_array and n == 0 and elem.empty()):
                    n += 1
                    yield replace(RawRecord(elem.line, None, RecordError("invalid_json", f"record {n} is empty"))
                                  if elem.empty() else elem.record(n), item=n)
                if end_of_array:
                    yield from _after_array(chunk[pos:], f)
                    return
                elem = _Element(lim, lines)
        elem.add(chunk[seg:])
        lines += chunk.count(b"\n", counted)
        chunk = f.read(1 << 16)
        pos = seg = counted = 0
        if not chunk:
            yield RawRecord(elem.line, None, RecordError("invalid_json", f"the file ends inside record {n + 1} "
                                                         "(unterminated array)"),
                            excerpt(bytes(elem.buf).strip(_WS), lim.excerpt_bytes), item=n + 1)
            return


def _after_array(rest: bytes, f: IO[bytes]) -> Iterator[RawRecord]:
    while True:
        if rest.strip(_WS):
            yield RawRecord(None, None, RecordError("invalid_json", "data after the end of the array"),
                            excerpt(rest.strip(_WS), 200))
            return
        rest = f.read(1 << 16)
        if not rest:
            return


# ---- Parquet, batch by batch ------------------------------------------------------------------------


PARQUET_BATCH_ROWS = 64  # rows decoded at a time: what Arrow holds is these rows' values
PARQUET_SLICE_BYTES = 8 << 20  # rows turned into Python objects at a time, by their size in Arrow


def read_parquet(f: IO[bytes], lim: Limits) -> Iterator[RawRecord]:
    """Batch by batch, each row's size taken from Arrow before it becomes Python objects: a row over
    max_record_bytes is quarantined unconverted, the others are converted a few MB at a time. (A 7 KB file can
    hold a 200 MB value, compressed, and a small dictionary-encoded one 300 MB of repeated strings: converted
    256 rows at a time and measured as JSON, they took the check 1.9 GB and 1.1 GB.)"""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f, buffer_size=1 << 20)  # a column chunk streamed, not read whole
        meta = pf.metadata
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        names = list(pf.schema_arrow.names)
    except Exception as e:  # not Parquet, or damaged beyond its footer
        yield RawRecord(None, None, RecordError("bad_file", f"cannot read as parquet: {type(e).__name__}: "
                                                f"{str(e).strip()}"))
        return
    if dupes := sorted({c for c in names if names.count(c) > 1}):  # as a CSV header (a row kept one, silently)
        yield RawRecord(None, None, RecordError("bad_file", f"the file names the columns {dupes} more than once: "
                                                "which column is meant is ambiguous"))
        return
    n = 0
    try:
        for g, group in enumerate(groups):
            if too_big := _oversized_column(group, lim):
                yield RawRecord(n + 1, None, RecordError("too_large", f"row group {g + 1} (rows {n + 1}-"
                                                         f"{n + group.num_rows}): {too_big}; not read"))
                n += group.num_rows
                continue
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g]):
                yield from _parquet_batch(batch, n, lim)
                n += batch.num_rows
    except Exception as e:  # a damaged row group: what was read stays
        yield RawRecord(None, None, RecordError("bad_file", f"cannot read past row {n}: {type(e).__name__}: "
                                                f"{str(e).strip()}"))


def _oversized_column(group: Any, lim: Limits) -> str | None:
    """A column whose values in a row group average more than max_record_bytes a row, uncompressed, where that
    is over 64 MiB (its pages decode whole whatever is read of them), as the file's metadata says; else None."""
    for c in range(group.num_columns):
        col = group.column(c)
        size = col.total_uncompressed_size
        if size > max(64 << 20, lim.max_record_bytes * max(1, group.num_rows)):
            return (f"its column '{col.path_in_schema}' holds {size:,} bytes uncompressed for {group.num_rows:,} "
                    f"rows, more than max_record_bytes {lim.max_record_bytes:,} a row")
    return None


def _parquet_batch(batch: Any, n: int, lim: Limits) -> Iterator[RawRecord]:
    """Rows n+1... of a decoded batch: a row over max_record_bytes unconverted, the others a few MB at a time."""
    sizes = _row_sizes(batch)
    i = 0
    while i < batch.num_rows:
        if sizes[i] > lim.max_record_bytes:
            n, i = n + 1, i + 1
            yield RawRecord(n, None, RecordError("too_large", f"row {n} of ~{sizes[i - 1]:,} bytes > "
                                                 f"max_record_bytes {lim.max_record_bytes:,} (not read)"))
            continue
        j, held = i, 0
        while j < batch.num_rows and sizes[j] <= lim.max_record_bytes and (
                j == i or held + sizes[j] <= PARQUET_SLICE_BYTES):
            held, j = held + sizes[j], j + 1
        yield from _parquet_rows(batch.slice(i, j - i), n, lim)
        n, i = n + j - i, j


def _row_sizes(batch: Any) -> list[int]:
    """Bytes each row's values take in Arrow (text by its length, a dictionary-encoded value by its own entry)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def each(values: Any) -> list[int]:
        t = values.type
        if any(f(t) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                              pa.types.is_large_binary)):
            return list(pc.binary_length(values).fill_null(0).to_pylist())
        if pa.types.is_primitive(t):
            return [8] * len(values)
        return [values.slice(k, 1).nbytes for k in range(len(values))]  # nested: each row's slice

    sizes = [0] * batch.num_rows
    for col in batch.columns:
        if pa.types.is_dictionary(col.type):
            lengths = each(col.dictionary)
            per = [0 if k is None else lengths[k] for k in col.indices.to_pylist()]
        else:
            per = each(col)
        sizes = [a + b for a, b in zip(sizes, per, strict=True)]
    return sizes


def _parquet_rows(piece: Any, n: int, lim: Limits) -> Iterator[RawRecord]:
    """Rows n+1... of a slice of a batch, as Python records."""
    try:
        rows: list[Any] | None = piece.to_pylist()
    except Exception:
        rows = None  # one value Python cannot hold: convert row by row to find it
    for i in range(piece.num_rows):
        n += 1
        try:
            row = rows[i] if rows is not None else piece.slice(i, 1).to_pylist()[0]
            size = len(json.dumps(row, default=str))
        except Exception as e:  # a value that converts to nothing Python or JSON can hold
            yield RawRecord(n, None, RecordError("wrong_type", f"row {n} cannot be converted: {type(e).__name__}"))
            continue
        yield (RawRecord(n, None, RecordError("too_large", f"row {n} of ~{size:,} bytes > max_record_bytes "
                                              f"{lim.max_record_bytes:,}"))
               if size > lim.max_record_bytes else RawRecord(n, row))
