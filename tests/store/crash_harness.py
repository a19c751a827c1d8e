"""Kill a night at each declared crash point in turn, restart it, and check what a restart finds.

`python -m tests.store.crash_harness PREPARED OUT` (run by tests/store/test_crash_points.py). One process
imports the night (torch, transformers) once; each night then runs in a forked child, so a point costs
two tiny CPU nights, not two interpreter starts (affordable on CI's 2 cores):

1. a reference night with no crash (NIGHTSHIFT_CRASH_AT set to a count no point reaches), which also
   counts how many times each point is reached;
2. for each point, at its first and (when reached more than once) its last occurrence: a copy of the
   prepared directory, a night SIGKILLed there by jobs/contract/crashpoints.py, then the same night
   started again without a crash.

Each result (one JSON line per trial in OUT/results.jsonl) holds what the test checks: how the crashed
child ended, the restart's outcome, the ledger's sample statuses and versions, the runs, whether
`current` verifies and what `doctor` found.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

NIGHT = "2026-11-21"
NEVER = 10**9  # an occurrence no point reaches: the night runs through and every point is counted


def prepared_config(root: Path) -> dict[str, Any]:
    """The night's config, its paths inside this copy (written with @ROOT@ in their place)."""
    return json.loads((root / "night.json").read_text().replace("@ROOT@", str(root)))


def _night(root: Path, crash_at: str | None, deadline: float) -> None:
    """In a forked child: one night over `root`, then exit (0: ran through; SIGKILL: the crash point)."""
    import torch

    from jobs.contract import crashpoints
    from jobs.night.config import NightConfig
    from jobs.night.run import run_night

    torch.set_num_threads(1)
    crashpoints._counts.clear()
    if crash_at is not None:
        os.environ[crashpoints.ENV] = crash_at
    else:
        os.environ.pop(crashpoints.ENV, None)
    cfg = NightConfig.model_validate(prepared_config(root))
    summary = run_night(cfg, night=NIGHT, deadline=deadline, emit=lambda ev: None, stop=threading.Event())
    if crash_at is not None and crash_at.endswith(f"@{NEVER}"):
        (root / "counts.json").write_text(json.dumps(crashpoints._counts))
    (root / "outcome.txt").write_text(summary.outcome.value)
    os._exit(0)


def _fork_night(root: Path, crash_at: str | None, deadline: float) -> str:
    """How the child ended: 'killed' (SIGKILL: the point was reached), 'exited', or 'failed <status>'."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _night(root, crash_at, deadline)
        except BaseException as e:
            (root / "error.txt").write_text(f"{type(e).__name__}: {e}")
        os._exit(70)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    code = os.waitstatus_to_exitcode(status)
    return "exited" if code == 0 else f"failed {code}"


def _state_of(root: Path) -> dict[str, Any]:
    """What a restart left: the ledger, the registry, doctor (read in this process: no torch needed)."""
    from jobs.store.doctor import diagnose
    from jobs.store.readonly import open_read_only
    from jobs.store.registry import Registry

    state = root / "state"
    led = open_read_only(state / "ledger.sqlite")
    try:
        samples = [dict(r) for r in led.db.execute("SELECT hash, status, version FROM samples")]
        versions = [(int(r["version"]), r["status"]) for r in led.versions()]
        runs = [(r["night"], r["status"]) for r in led.db.execute("SELECT night, status FROM runs ORDER BY rowid")]
        quarantined = led.db.execute("SELECT COUNT(DISTINCT file || ':' || line) FROM quarantine").fetchone()[0]
    finally:
        led.close()
    reg = Registry(state, create=False)
    current, verified = reg.current(), None
    if current is not None:
        try:
            verified = reg.verify(current).get("version")
        except Exception as e:
            verified = f"{type(e).__name__}: {e}"
    inbox = root / "inbox"
    left = sorted(p.name for p in inbox.iterdir() if p.is_file())
    problems = [f"{f.check}: {f.message}" for f in diagnose(state) if f.level == "problem"]
    return {"samples": samples, "versions": versions, "runs": runs, "quarantined": quarantined,
            "current": current.name if current else None, "verified": verified, "inbox_left": left,
            "doctor_problems": problems}


NIGHT_POINTS = ("ledger.", "pull.", "quarantine.", "token_cache.", "registry.", "publish.", "files.")
"""The families a night's own writes declare; the training loop's (`train.`), the operator commands' (`adapters.`)
and the capture process's (`capture.`) are killed by their own tests (tests/test_crash_point_owners.py)."""


def trial(prepared: Path, out: Path, crash_at: str | None) -> dict[str, Any]:
    root = out / (crash_at or "reference").replace("@", "-at-")
    shutil.copytree(prepared, root, symlinks=True)
    deadline = time.time() + 3600
    first = _fork_night(root, crash_at, deadline)
    outcome_first = (root / "outcome.txt").read_text() if (root / "outcome.txt").exists() else None
    error_first = (root / "error.txt").read_text() if (root / "error.txt").exists() else None
    restart = None
    if crash_at is not None and not crash_at.endswith(f"@{NEVER}"):
        (root / "outcome.txt").unlink(missing_ok=True)
        restart = _fork_night(root, None, deadline)
    result = {"point": crash_at, "first": first, "first_outcome": outcome_first, "first_error": error_first,
              "restart": restart, "restart_outcome": (root / "outcome.txt").read_text()
              if (root / "outcome.txt").exists() else None,
              "restart_error": (root / "error.txt").read_text() if (root / "error.txt").exists() else None,
              **_state_of(root)}
    if (root / "counts.json").exists():
        result["counts"] = json.loads((root / "counts.json").read_text())
    if crash_at is not None and result["restart"] == "exited" and not result["doctor_problems"]:
        shutil.rmtree(root, ignore_errors=True)  # keep only what failed, for the test's message
    return result


def main(argv: list[str]) -> int:
    prepared, out = Path(argv[0]), Path(argv[1])
    import jobs.night.run  # noqa: F401  (torch, transformers and every crash point: imported once, then forked)
    from jobs.contract import crashpoints

    points = sorted(p for p in crashpoints.POINTS if p.startswith(NIGHT_POINTS))
    results = out / "results.jsonl"
    with results.open("w") as f:
        ref = trial(prepared, out, f"{points[0]}@{NEVER}")
        f.write(json.dumps(ref) + "\n")
        f.flush()
        counts: dict[str, int] = ref.get("counts", {})
        for name in points:
            for nth in sorted({1, counts.get(name, 1)}):
                f.write(json.dumps(trial(prepared, out, f"{name}@{nth}")) + "\n")
                f.flush()
    (out / "declared.json").write_text(json.dumps({p: crashpoints.POINTS[p] for p in points}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
