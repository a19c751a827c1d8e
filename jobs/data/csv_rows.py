"""CSV files read row by row against their header, each row and each record bounded (the JSON and Parquet readers:
jobs/data/readers.py). A record that cannot be kept (too large, not UTF-8) is read to its end, quotes and all, and
quarantined alone; the rows after it are read as rows."""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Iterator
from typing import IO

from jobs.data.formats import RecordError
from jobs.data.readers import BOM, Limits, RawRecord, excerpt, foreign_encoding


class _LineProblem(Exception):
    def __init__(self, rec: RawRecord) -> None:
        self.rec = rec


_QUOTE_OR_END = re.compile(rb'["\n]')
_START, _FIELD, _QUOTED, _QUOTE_IN_QUOTED = range(4)


def csv_state(data: bytes, state: int = _START) -> int:
    """The csv module's quoting state after `data` (the default dialect, strict off): a record ends at a newline
    read outside quotes. Lets a record that cannot be kept be skipped to its end, so the rows after it are read
    as rows (a reader restarted inside a quoted field read each of its lines as a bad row: 75,714 for one).
    Outside quotes only a quote or a newline matters, and whether a quote opens a field is told by the byte
    before it: one search per quote, not one step per field."""
    i, n = 0, len(data)
    while i < n:
        if state == _QUOTED:
            j = data.find(b'"', i)
            if j < 0:
                return state
            state, i = _QUOTE_IN_QUOTED, j + 1
        elif state == _QUOTE_IN_QUOTED:  # a doubled quote is text; anything else ends the quoted part
            c = data[i : i + 1]
            state = _QUOTED if c == b'"' else _START if c in (b",", b"\n") else _FIELD
            i += 1
        else:  # outside quotes: a quote opens a field only as its first character (else it is text)
            m = _QUOTE_OR_END.search(data, i)
            if m is None:
                return state if i == n else _START if data[-1:] == b"," else _FIELD
            j = m.start()
            at_start = data[j - 1 : j] == b"," if j > i else state == _START
            state = _START if m.group() == b"\n" else _QUOTED if at_start else _FIELD
            i = j + 1
    return state


class _Lines:
    """Decoded physical lines for csv.reader, each and each record bounded; a problem is raised to the
    reader's caller once the record it is in has been read to its end (the caller starts a new reader
    after it, at the next record), and the iterator stays usable."""

    def __init__(self, f: IO[bytes], lim: Limits) -> None:
        self.f, self.lim, self.n = f, lim, 0
        self.start, self.record_bytes, self.record = 1, 0, list[bytes]()

    def __iter__(self) -> _Lines:
        return self

    def new_record(self) -> None:
        self.start, self.record_bytes, self.record = self.n + 1, 0, []

    def __next__(self) -> str:
        lim = self.lim
        raw = self.f.readline(lim.max_record_bytes + 1)
        if not raw:
            raise StopIteration
        self.n += 1
        if self.n == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        self.record_bytes += len(raw)
        self.record.append(raw)
        if self.record_bytes > lim.max_record_bytes:
            size, digest, head = self._skip_record()
            what = (f"a line of {size:,} bytes" if self.n == self.start
                    else f"a record of lines {self.start}-{self.n}, {size:,} bytes,")
            raise _LineProblem(RawRecord(self.start, None, RecordError(
                "too_large", f"{what} > max_record_bytes {lim.max_record_bytes:,} (skipped unread)"),
                excerpt(head, lim.excerpt_bytes), size, digest))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            detail = f"not UTF-8: {e}" + ("" if self.n == self.start else f" (line {self.n} of the record)")
            self._skip_record()
            raise _LineProblem(RawRecord(self.start, None, RecordError("invalid_utf8", detail),
                                         raw[: lim.excerpt_bytes].hex())) from None

    def _skip_record(self) -> tuple[int, str, bytes]:
        """Read the rest of the current record unkept: its size, sha256 and head (only the head is held)."""
        h, size, state = hashlib.sha256(), 0, _START
        for piece in self.record:
            h.update(piece)
            size += len(piece)
            state = csv_state(piece, state)
        head, last = b"".join(self.record)[: self.lim.excerpt_bytes], self.record[-1]
        self.record = []
        while not (last.endswith(b"\n") and state != _QUOTED):
            new_line, last = last.endswith(b"\n"), self.f.readline(1 << 20)
            if not last:
                break
            self.n += new_line
            h.update(last)
            size += len(last)
            state = csv_state(last, state)
        return size, h.hexdigest(), head


def _csv_problem(e: csv.Error) -> str:
    if "new-line character seen in unquoted field" in str(e):
        return ("a carriage return inside an unquoted field (lines that end in a carriage return alone, as old Mac "
                "exports write them? save the file with \\n or \\r\\n line endings)")
    return f"CSV: {e}"


def read_csv(f: IO[bytes], lim: Limits) -> Iterator[RawRecord]:
    """Every cell is text; the first row is the header (unique names, at least one a field the source reads); each
    row is checked against it: more or fewer fields quarantine that row alone, never shift its columns."""
    if foreign := foreign_encoding(f):
        yield foreign
        return
    csv.field_size_limit(max(csv.field_size_limit(), lim.max_record_bytes))
    lines = _Lines(f, lim)
    reader = csv.reader(lines)
    header: list[str] | None = None
    while True:
        lines.new_record()
        start = lines.start
        try:
            row = next(reader)
        except StopIteration:
            return
        except (_LineProblem, csv.Error) as e:
            rec = e.rec if isinstance(e, _LineProblem) else RawRecord(start, None, RecordError("bad_row",
                                                                                              _csv_problem(e)))
            if header is None:  # without a header no row can be read
                yield RawRecord(None, None, RecordError("bad_file", f"unreadable header (line {rec.line}): "
                                                        f"{rec.error.detail if rec.error else ''}"), rec.raw)
                return
            yield rec
            reader = csv.reader(lines)
            continue
        if not row or (len(row) == 1 and not row[0].strip() and header is not None):
            continue  # a blank line
        if header is None:
            header = [h.strip() for h in row]
            dupes = sorted({h for h in header if header.count(h) > 1})
            problem = (f"the header names {dupes} more than once: which column is meant is ambiguous" if dupes
                       else _no_known_column(header, lim))
            if problem:
                yield RawRecord(None, None, RecordError("bad_file", problem), ",".join(row)[:500])
                return
            continue
        if len(row) != len(header):
            yield RawRecord(start, None, RecordError("bad_row", f"{len(row)} fields where the header has "
                                                     f"{len(header)} ({', '.join(header)[:200]})"),
                            ",".join(row)[: lim.excerpt_bytes])
            continue
        yield RawRecord(start, dict(zip(header, row, strict=True)))


def _no_known_column(header: list[str], lim: Limits) -> str | None:
    """Why a first line is no header the source can read (it names none of its fields), or None."""
    if not lim.fields or lim.fields & set(header):
        return None
    hint = " (fields separated by ';'? the inbox reads ',')" if any(";" in h for h in header) else ""
    return (f"line 1 names none of the fields this source reads ({', '.join(sorted(lim.fields))}){hint}: a CSV "
            f"file's first line must be its header (got {', '.join(repr(h) for h in header[:8])[:300]})")
