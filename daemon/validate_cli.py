"""`nightshift validate FILE...`: check data files before dropping them into an inbox.

The reading happens in a child (`python -m jobs.night.validate`: the daemon never imports the
training stack), exactly as the inbox reads; this module renders its per-file reports. Nothing
is written: not the ledger, not a quarantine file, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from daemon.settings import Settings
from daemon.supervisor import child_env
from jobs.contract import ExitCode, FileCheck, QuarantineReason


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "validate", help="check data files as the inbox would read them; writes nothing",
        description="Read each FILE exactly as the inbox would (file type, format, field map, chat template, "
                    "max_seq_length) and print what would train, every record that would be quarantined, "
                    "with its line and reason, and what cannot be read now. Exit status 1 if any record would be "
                    "quarantined or a file cannot be read.")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="JSONL, JSON array, Parquet or CSV files; a directory (a source's inbox, or files to "
                        "check before they are dropped in) for the files in it")
    p.add_argument("--source", metavar="NAME",
                   help="read as this [[sources]] entry (format, field_map, patterns); default: the source "
                        "whose inbox holds the file, else the first one")
    p.add_argument("--json", action="store_true", help="one JSON object per file instead of text")
    p.set_defaults(func=cmd_validate)


def run_checks(s: Settings, files: list[Path], source: str | None) -> tuple[int, list[FileCheck]]:
    cmd = [sys.executable, "-m", "jobs.night.validate", *(["--source", source] if source else []),
           "--", *map(str, files)]
    r = subprocess.run(cmd, input=s.night_config().model_dump_json(), stdout=subprocess.PIPE, text=True,
                       env=child_env())
    return r.returncode, [FileCheck.model_validate_json(line) for line in r.stdout.splitlines() if line.strip()]


def render(checks: list[FileCheck]) -> str:
    out: list[str] = []
    for c in checks:
        out.append(f"{c.file}  (source '{c.source}')")
        if c.already_ingested:
            out.append("  already ingested (the ledger has this very file): the inbox would skip it")
        if c.note:
            out.append(f"  note: {c.note}")
        quarantined = sum(p.reason != QuarantineReason.unreadable for p in c.problems)
        out.append(f"  {c.records:,} records: {c.would_train:,} would train ({c.tokens:,} tokens), "
                   f"{c.known:,} already in the ledger, {c.repeated:,} repeated, "
                   f"{quarantined:,} would be quarantined")
        for p in c.problems:  # an unreadable file is left in the inbox by the pull: not quarantined
            out.append(f"  {p.where}: {p.detail} (a night leaves it in the inbox and tries it again)"
                       if p.reason == QuarantineReason.unreadable else f"  {p.where}: {p.reason.value}: {p.detail}")
    bad = Counter(p.reason.value for c in checks for p in c.problems if p.reason != QuarantineReason.unreadable)
    total = f"{len(checks)} file(s): {sum(c.would_train for c in checks):,} records would train, "
    total += f"{sum(bad.values()):,} would be quarantined" + (
        f" ({', '.join(f'{k} {v}' for k, v in sorted(bad.items()))})" if bad else "")
    if unread := sum(p.reason == QuarantineReason.unreadable for c in checks for p in c.problems):
        total += f", {unread:,} cannot be read now (a night retries them)"
    return "\n".join([*out, total])


def inbox_files(s: Settings, files: list[Path]) -> list[Path]:
    """A directory named as a FILE (`nightshift validate inbox`, `nightshift validate incoming/`) stands for what
    is in it, in name order (hidden names and directories left out, as an inbox leaves them); one inside an inbox
    (processed/, a Spark `x.parquet/` that `validate inbox/*` names) is reported as the inbox would take it."""
    inboxes = {Path(src.inbox).resolve() for src in s.sources}
    out: list[Path] = []
    for f in files:
        within = f.resolve() not in inboxes and any(f.resolve().is_relative_to(i) for i in inboxes)
        if f.is_dir() and not f.is_symlink() and not within:
            out += sorted(p for p in f.iterdir() if not p.name.startswith(".") and (p.is_symlink() or not p.is_dir()))
        else:
            out.append(f)
    return out


def cmd_validate(args: argparse.Namespace, s: Settings) -> int:
    wrong = [f"{f}: no such file" for f in args.files if not os.path.lexists(f)]
    if wrong:  # a mistyped name is the command line's fault; a directory, link, FIFO or device is reported as the
        # inbox would take it (`validate inbox/*` names its processed/ directory, and whatever a producer left there)
        print("\n".join(f"nightshift validate: {w}" for w in wrong), file=sys.stderr)
        return ExitCode.USAGE
    files = inbox_files(s, args.files)
    if not files:  # only empty directories: nothing to read, and nothing wrong with that
        print(f"0 file(s): {', '.join(str(f) for f in args.files)} holds no files")
        return ExitCode.OK
    rc, checks = run_checks(s, files, args.source)
    if rc != ExitCode.OK:
        print(f"nightshift validate: the check failed (exit status {rc})", file=sys.stderr)
        return rc if rc == ExitCode.USAGE else ExitCode.FAILED
    if args.json:
        print(json.dumps([c.model_dump(mode="json") for c in checks], indent=2))
    else:
        print(render(checks))
    return ExitCode.FAILED if any(c.problems for c in checks) else ExitCode.OK
