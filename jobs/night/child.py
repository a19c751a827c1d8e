"""The night's child process: `python -m jobs.night.child --night N --deadline TS < night-config.json`.

The daemon never imports torch; this process does, and its exit returns every byte
of VRAM. Events go out as JSON lines on the original stdout; anything else a library
prints is redirected to stderr (the log). SIGTERM asks for a graceful stop: the
trainer checkpoints and the process exits with EXIT_INTERRUPTED.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

import structlog

from jobs.contract import ChildEvent, ExitCode, Outcome, ResultEvent, RunSummary, outcome_exit_code
from jobs.store.files import DamagedState
from jobs.store.locking import LockTimeout, inherited_night_lock, night_lock

PROCESS_STARTED = time.time()  # the night's "wake": before torch and the model are imported (in main)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.child")
    ap.add_argument("--night", required=True)
    ap.add_argument("--deadline", type=float, required=True, help="unix seconds")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--run-id", help="the id of a new run (the supervisor logs under it); an open run keeps its own")
    args = ap.parse_args(argv)

    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the event stream
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def emit(ev: ChildEvent) -> None:
        with lock:
            events.write(ev.model_dump_json() + "\n")

    from jobs import logs

    logs.configure(os.environ.get("NIGHTSHIFT_LOG_LEVEL", "INFO"))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    raw = sys.stdin.read()
    _import_unsloth_first(json.loads(raw))
    from jobs.night.config import NightConfig
    from jobs.night.run import failure_text, run_night

    cfg = NightConfig.model_validate_json(raw)
    logs.route_transformers_logging()
    with contextlib.ExitStack() as held:
        if not args.plan_only and not inherited_night_lock(cfg.state_dir):  # started by hand: take it here
            try:
                held.enter_context(night_lock(cfg.state_dir, what=f"night {args.night} (child {os.getpid()})"))
            except LockTimeout as e:
                print(f"nightshift: {e}", file=sys.stderr)
                return ExitCode.BUSY
        try:
            summary = run_night(cfg, night=args.night, deadline=args.deadline, emit=emit, stop=stop,
                                plan_only=args.plan_only, run_id=args.run_id,
                                process_started=PROCESS_STARTED)
        except (DamagedState, OSError, sqlite3.Error) as e:  # before a run could open: the model, the ledger
            summary = RunSummary(night=args.night, outcome=Outcome.failed, error=failure_text(e))
            structlog.get_logger("nightshift.night").error("night_refused", error=summary.error)
    emit(ResultEvent(summary=summary))
    return outcome_exit_code(summary.outcome)


def _import_unsloth_first(cfg: dict[str, Any]) -> None:
    """Unsloth patches transformers when imported, so it must come before anything that imports it."""
    import importlib.util

    if cfg.get("train", {}).get("backend", "auto") in ("auto", "unsloth") and importlib.util.find_spec("unsloth"):
        import torch

        if torch.cuda.is_available():
            import unsloth  # noqa: F401


if __name__ == "__main__":
    sys.exit(main())
