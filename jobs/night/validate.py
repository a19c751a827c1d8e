"""`nightshift validate FILE...`: read files exactly as the inbox would, and change nothing.

A child process like the night, since the check needs the model's tokenizer (the chat template
and the lengths): `python -m jobs.night.validate [--source NAME] FILE... < night-config.json`
prints one FileCheck (jobs/contract/) per file as a JSON line on stdout. The records go through
the pull's own reading (jobs.data.check.checked_records: reader, format, field map, template,
length), so what validate accepts is what the inbox accepts. The ledger is opened read-only, only
to say which records it already holds.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jobs.contract import ExitCode, FileCheck, QuarantineReason, RecordProblem
from jobs.data.check import checked_records
from jobs.data.inbox import BELOW_THE_INBOX, Refused, admitted, printable, roots
from jobs.data.sources import SourceConfig
from jobs.night.config import NightConfig
from jobs.store.files import sha256_file
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths


def source_for(path: Path, sources: Sequence[SourceConfig], name: str | None = None) -> SourceConfig:
    """The source whose format and field map apply: the one named, else the one whose inbox holds the
    file (whose patterns take its name, where several share the inbox), else the first one configured,
    else the defaults (format auto, no field map)."""
    if name is not None:
        return next(s for s in sources if s.name == name)
    where = path.parent.resolve()  # the directory named, not where a link in it points
    here = [s for s in sources if Path(s.inbox).resolve() == where]
    for s in here:  # sources sharing an inbox tell their files apart by their patterns
        if any(fnmatch.fnmatch(path.name, pat) for pat in s.patterns):
            return s
    if here:
        return here[0]
    return sources[0] if sources else SourceConfig(name="default", inbox=path.parent)


def check_files(paths: Sequence[Path], cfg: NightConfig, tokenizer: Any, ledger: Ledger, *,
                source: str | None = None) -> Iterator[FileCheck]:
    seen: set[str] = set()  # content hashes of the valid records so far, over all the files
    contents: dict[tuple[str, str], str] = {}  # (source, file sha256) -> the first file named with that content
    for path in paths:
        src = source_for(path, cfg.sources, source)
        counts = {"records": 0, "would_train": 0, "known": 0, "repeated": 0, "tokens": 0}
        problems: list[RecordProblem] = []
        already = False
        note = None
        if not any(fnmatch.fnmatch(path.name, pat) for pat in src.patterns):
            note = f"the inbox of source '{src.name}' would not pick this name up (patterns {src.patterns})"
        elif path.name.startswith("."):
            note = f"the inbox of source '{src.name}' would not pick this name up (it starts with '.')"
        if path.is_dir() and not path.is_symlink():
            note = f"a directory: an inbox reads none of it ({BELOW_THE_INBOX})"
            yield FileCheck(file=printable(path), source=src.name, already_ingested=False, problems=[], note=note,
                            **counts)
            continue
        try:
            if not os.path.lexists(path):
                raise OSError(f"{path}: no such file")
            inbox = Path(src.inbox).resolve()
            # as the inbox opens it: in an inbox, its links followed only inside it (or allow_symlinks_to)
            admitted(path, roots(src) if path.parent.resolve().is_relative_to(inbox) else [Path("/")])
            digest = sha256_file(path)
            already = ledger.file_known_by_hash(src.name, digest)
            if (first := contents.setdefault((src.name, digest), printable(path))) != printable(path):
                note = f"the same content as {first}: an inbox reads it once"  # as the pull: known by its hash
                yield FileCheck(file=printable(path), source=src.name, already_ingested=already, problems=[],
                                note=note, **counts)
                continue
            for c in checked_records(path, src, tokenizer, max_seq_length=cfg.train.max_seq_length,
                                     overlong=cfg.train.overlong, special_tokens=cfg.train.special_tokens,
                                     excerpt_bytes=cfg.quarantine.excerpt_bytes):
                counts["records"] += 1
                if c.error is not None:
                    problems.append(RecordProblem(line=c.raw.line, item=c.raw.item, reason=c.error.reason,
                                                  detail=printable(c.error.detail)))
                elif c.norm is not None and c.tokens is not None:
                    if c.norm.hash in seen:
                        counts["repeated"] += 1
                    elif ledger.has_sample(c.norm.hash):
                        counts["known"] += 1
                    else:
                        counts["would_train"] += 1
                        counts["tokens"] += c.tokens.n_tokens
                    seen.add(c.norm.hash)
        except Refused as e:  # what the inbox would not open
            problems.append(RecordProblem(line=None, reason=QuarantineReason(e.reason), detail=e.detail))
        except OSError as e:  # as the pull takes it: left in the inbox, read again at the next night (not bad_file)
            problems.append(RecordProblem(line=None, reason=QuarantineReason.unreadable,
                                          detail=printable(f"cannot be read now: {e.strerror or e}")))
        except Exception as e:  # validate reports, it never stops on a file
            problems.append(RecordProblem(line=None, reason=QuarantineReason.bad_file,
                                          detail=printable(f"cannot read: {type(e).__name__}: {e}")))
        yield FileCheck(file=printable(path), source=src.name, already_ingested=already, problems=problems, note=note,
                        **counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.validate")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--source", help="apply this [[sources]] entry's format and field map")
    args = ap.parse_args(argv)
    cfg = NightConfig.model_validate_json(sys.stdin.read())
    if args.source is not None and args.source not in {s.name for s in cfg.sources}:
        print(f"--source: no [[sources]] is named {args.source!r} (configured: "
              f"{', '.join(s.name for s in cfg.sources) or 'none'})", file=sys.stderr)
        return ExitCode.USAGE

    from jobs.runtime import logs

    logs.configure("WARNING")
    logs.route_transformers_logging()
    from jobs.night.model import model_to_read
    from jobs.store.readonly import open_read_only
    from jobs.training.load import load_tokenizer

    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the JSON lines
    with model_to_read(cfg) as model_path:
        tokenizer = load_tokenizer(model_path)
        for night, files in _by_adapter(cfg, args.files, args.source):
            ledger = open_read_only(StatePaths(night.state_dir).ledger)
            try:
                for check in check_files(files, night, tokenizer, ledger, source=args.source):
                    out.write(check.model_dump_json() + "\n")
                    out.flush()
            finally:
                ledger.close()
    return ExitCode.OK


def _by_adapter(cfg: NightConfig, files: Sequence[Path], source: str | None) -> list[tuple[NightConfig, list[Path]]]:
    """[[adapters]]: each file read by the adapter whose source takes it (its ledger knows what it has)."""
    if not cfg.adapters:
        return [(cfg, list(files))]
    out: dict[str, tuple[NightConfig, list[Path]]] = {}
    for path in files:
        src = source_for(path, cfg.sources, source)
        night = next((a.night for a in cfg.adapters if src.name in {x.name for x in a.night.sources}),
                     cfg.adapters[0].night)
        out.setdefault(str(night.state_dir), (night, []))[1].append(path)
    return list(out.values())


if __name__ == "__main__":
    sys.exit(main())
