"""`nightshift doctor [--json]`: is the state directory whole? The ledger, the registry and `current`
checked against each other, each problem with how to repair it. Read-only; exit 0 when nothing is
wrong, 1 when something is (notes alone do not fail it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from jobs.contract import ExitCode
from jobs.store.doctor import as_dicts, diagnose

MARK = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM"}


def add_command(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check the ledger, the adapter registry and `current` against each other; "
                       "say how to repair what is wrong (read-only)")
    p.add_argument("--json", action="store_true", help="the findings as JSON (ok, and each finding with its repair)")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace, s: Any) -> int:
    findings = diagnose(s.state_dir, name=s.model.name, lock_timeout=s.registry.lock_timeout_seconds)
    problems = [f for f in findings if f.level == "problem"]
    if args.json:
        print(json.dumps({"state_dir": str(s.state_dir), "ok": not problems, "findings": as_dicts(findings)},
                         indent=2))
    else:
        print(f"nightshift doctor: {s.state_dir}")
        for f in findings:
            print(f"  {MARK[f.level]} {f.subject}: {f.text}")
            if f.fix:
                print(f"          fix: {f.fix}")
        print(f"{len(problems)} problem(s)" if problems else "no problems found")
    return ExitCode.FAILED if problems else ExitCode.OK
