"""Read the files that appeared in a source's inbox, record by record.

JSONL is parsed line by line so one bad line is quarantined on its own; JSON arrays,
Parquet and CSV are loaded with `datasets` (a file it cannot read is quarantined
whole). Nothing in the inbox is ever deleted.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.data.formats import Format, RecordError

READERS = (".jsonl", ".json", ".parquet", ".csv")


class SourceConfig(BaseModel):
    """[[sources]]: a directory that other systems drop data files into."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["directory"] = "directory"
    inbox: Path
    patterns: list[str] = ["*.jsonl", "*.json", "*.parquet", "*.csv"]
    format: Format = "auto"
    field_map: dict[str, str] = Field(default_factory=dict, description="their field name -> ours")
    move_processed: bool = False  # move a fully ingested file to <inbox>/processed/
    settle_seconds: float = 5.0  # files modified more recently may still be being written


@dataclass(frozen=True)
class RawRecord:
    line: int | None  # 1-based line (JSONL) or record number (other formats); None = the whole file
    record: Any | None  # the decoded record, or None when it could not be decoded
    error: RecordError | None = None
    raw: str | None = None  # what to keep in quarantine when the record could not be decoded


def new_files(cfg: SourceConfig, *, now: float | None = None) -> list[Path]:
    """Candidate files, oldest first; the ledger decides which of them are new."""
    now = time.time() if now is None else now
    inbox = Path(cfg.inbox)
    if not inbox.is_dir():
        raise FileNotFoundError(f"source '{cfg.name}': inbox {inbox} is not a directory")
    found = {p for pat in cfg.patterns for p in inbox.glob(pat) if p.is_file() and not p.name.startswith(".")}
    fresh = [p for p in found if now - p.stat().st_mtime >= cfg.settle_seconds]
    return sorted(fresh, key=lambda p: (p.stat().st_mtime, p.name))


def read_records(path: Path, cache_dir: Path) -> Iterator[RawRecord]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix in READERS:
        yield from _read_with_datasets(path, suffix, cache_dir)
    else:
        yield RawRecord(None, None, RecordError("bad_file", f"unsupported file type '{suffix}'"))


def _read_jsonl(path: Path) -> Iterator[RawRecord]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRecord(n, None, RecordError("invalid_utf8", f"not UTF-8: {e}"), raw.hex())
                continue
            try:
                yield RawRecord(n, json.loads(text))
            except json.JSONDecodeError as e:
                yield RawRecord(n, None, RecordError("invalid_json", f"invalid JSON: {e}"), text.rstrip("\n"))
            except RecursionError:  # nested deeper than the parser goes: no record of ours looks like that
                yield RawRecord(n, None, RecordError("invalid_json", "invalid JSON: nested too deeply"),
                                text.rstrip("\n")[:1000])


def _read_with_datasets(path: Path, suffix: str, cache_dir: Path) -> Iterator[RawRecord]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if suffix == ".json":
            _check_utf8(path)
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise RecordError("bad_file", f"a .json file must hold an array of records, got {type(data).__name__}")
            # JSON arrays are loaded directly: datasets would unify the records' schemas
            # and turn a wrongly typed field into a load failure of the whole file.
            rows: Any = data
        elif suffix == ".parquet":
            rows = datasets.Dataset.from_parquet(str(path), cache_dir=str(cache_dir), keep_in_memory=True)
        else:  # .csv: every cell is text; empty cells stay empty strings, not NaN
            _check_utf8(path)
            with open(path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            features = datasets.Features({c: datasets.Value("string") for c in header})
            rows = datasets.Dataset.from_csv(
                str(path), cache_dir=str(cache_dir), keep_in_memory=True, features=features, na_filter=False
            )
    except RecordError as e:
        yield RawRecord(None, None, e)
        return
    except UnicodeDecodeError as e:
        yield RawRecord(None, None, RecordError("invalid_utf8", f"not UTF-8: {e}"))
        return
    except json.JSONDecodeError as e:
        yield RawRecord(None, None, RecordError("invalid_json", f"invalid JSON: {e}"))
        return
    except Exception as e:  # any reader failure means the file is not what it claims
        yield RawRecord(None, None, RecordError("bad_file", f"cannot read as {suffix[1:]}: {type(e).__name__}: {e}"))
        return
    for n, rec in enumerate(rows, start=1):
        yield RawRecord(n, rec)


def _check_utf8(path: Path) -> None:
    path.read_bytes().decode("utf-8")
