"""`nightshift doctor [--json]`: is the state directory whole? The ledger, the registry and `current`
checked against each other, each problem with how to repair it. Read-only; exit 0 when nothing is
wrong, 1 when something is (notes alone do not fail it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from daemon.lineage import lineage_notes, lineage_problems
from daemon.preflight import disk_problem
from jobs.contract import ExitCode
from jobs.store.doctor import Finding, as_dicts, diagnose
from jobs.store.paths import StatePaths

MARK = {"ok": "ok     ", "note": "note   ", "problem": "PROBLEM"}


def add_command(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check the ledger, the adapter registry and `current` against each other; "
                       "say how to repair what is wrong (read-only)")
    p.add_argument("--json", action="store_true", help="the findings as JSON (ok, and each finding with its repair)")
    p.set_defaults(func=cmd_doctor)


def disk(s: Any) -> list[Finding]:
    """A full disk fails nights with "database or disk is full" while the state itself is whole: said here."""
    problem = disk_problem(s.state_dir, s.daemon.min_free_disk_gb)
    return [Finding("problem", "disk", problem.split(": ", 1)[0] + ": `once` and the service refuse to start, "
                    "and a night running out of space fails", problem.split(": ", 1)[1])] if problem else []


def cmd_doctor(args: argparse.Namespace, s: Any) -> int:
    timeout = s.registry.lock_timeout_seconds
    config = ([Finding("problem", "config", text) for text in lineage_problems(s)]  # daemon/lineage.py
              + [Finding("note", "config", text) for text in lineage_notes(s)])
    places = [("", s.state_dir, config + disk(s) + diagnose(s.state_dir, name=s.model.name, lock_timeout=timeout))]
    for a in getattr(s, "adapters", None) or []:  # [[adapters]]: each adapter's own state directory
        state = StatePaths(s.state_dir).adapter(a.name).root
        places.append((a.name, state, diagnose(state, name=a.name, lock_timeout=timeout)))
    problems = [f for _, _, found in places for f in found if f.level == "problem"]
    if args.json:
        top = places[0][2]
        doc: dict[str, Any] = {"state_dir": str(s.state_dir), "ok": not problems, "findings": as_dicts(top)}
        if len(places) > 1:
            doc["adapters"] = {name: {"state_dir": str(state), "ok": not any(f.level == "problem" for f in found),
                                      "findings": as_dicts(found)} for name, state, found in places[1:]}
        print(json.dumps(doc, indent=2))
    else:
        for name, state, found in places:
            print(f"nightshift doctor: {state}" + (f" (adapter {name}; its commands take --adapter {name})"
                                                   if name else ""))
            for f in found:
                print(f"  {MARK[f.level]} {f.subject}: {f.text}")
                if f.fix:
                    print(f"          fix: {f.fix}")
        print(f"{len(problems)} problem(s)" if problems else "no problems found")
    return ExitCode.FAILED if problems else ExitCode.OK
