"""Sources: a directory that other systems drop data files into, and reading its files record by record.

Listing the inbox (which files, symbolic links, special files) is `jobs/data/inbox.py`; decoding
a file into records, each inside its own guard and with bounded memory, is `jobs/data/readers.py` (JSON
Lines, JSON arrays, Parquet) and `jobs/data/csv_rows.py` (CSV); `read_stream` picks the reader.
Nothing in the inbox is ever deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jobs.data.csv_rows import read_csv
from jobs.data.formats import RECORD_FIELDS, Format, RecordError
from jobs.data.preference import PREFERENCE_KEYS
from jobs.data.readers import Limits, RawRecord, read_json_array, read_jsonl, read_parquet

__all__ = ["Limits", "RawRecord", "SourceConfig", "read_records"]


class SourceConfig(BaseModel):
    """[[sources]]: a directory that other systems drop data files into."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["directory"] = "directory"
    inbox: Path
    patterns: list[str] = Field(["*.jsonl", "*.json", "*.parquet", "*.csv"], min_length=1,
                                description="file names to read (case-insensitive; with a '/': a glob below the "
                                "inbox, case-sensitive)")
    format: Format = "auto"
    field_map: dict[str, str] = Field(default_factory=dict, description="their field name -> ours")
    move_processed: bool = False  # move a fully ingested file to <inbox>/processed/
    settle_seconds: float = Field(5.0, ge=0, description="files modified more recently may still be being written")
    max_record_bytes: int = Field(1 << 20, ge=1024, le=1 << 30,
                                  description="bytes of one record read into memory; a longer one is quarantined")
    allow_symlinks_to: list[Path] = Field(
        default_factory=list, description="directories symbolic links in the inbox may point into (default: only "
        "the inbox itself); any other link is reported and not read")

    @field_validator("patterns")
    @classmethod
    def _inside_the_inbox(cls, v: list[str]) -> list[str]:
        for pat in v:
            if not pat.strip() or pat.startswith(("/", "~")) or ".." in Path(pat).parts:
                raise ValueError(f"pattern {pat!r} must name files inside the inbox (no '/' at the start, no '..')")
        return v

    def limits(self, excerpt_bytes: int = 16384) -> Limits:
        return Limits(max_record_bytes=self.max_record_bytes, excerpt_bytes=excerpt_bytes, fields=self.fields())

    def fields(self) -> frozenset[str]:
        """The names a record of this source is read by: ours and, through `field_map`, theirs (a CSV header
        naming none of them is no header)."""
        return frozenset(RECORD_FIELDS) | frozenset(PREFERENCE_KEYS) | frozenset(self.field_map)


def read_records(path: Path, limits: Limits | None = None) -> Iterator[RawRecord]:
    """A file the operator named (the regression set): every record, or why it is not one."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed below; a generator)
    except OSError as e:
        yield RawRecord(None, None, RecordError("unreadable", f"cannot open: {e.strerror or e}"))
        return
    with f:
        yield from read_stream(f, Path(path).suffix, limits or Limits())


READERS = {".jsonl": read_jsonl, ".json": read_json_array, ".csv": read_csv, ".parquet": read_parquet}


def read_stream(f: IO[bytes], suffix: str, lim: Limits) -> Iterator[RawRecord]:
    reader = READERS.get(suffix.lower())
    if reader is None:
        yield RawRecord(None, None, RecordError("bad_file", f"unsupported file type '{suffix}'"))
        return
    yield from reader(f, lim)
