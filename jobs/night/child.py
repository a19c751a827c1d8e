"""The night's child process: `python -m jobs.night.child --night N --deadline TS < night-config.json`
(or `--config FILE`: under torchrun every worker shares the launcher's stdin, so the config comes as a file).

The daemon never imports torch; this process does, and its exit returns every byte
of VRAM. Events go out as JSON lines on the original stdout; anything else a library
prints is redirected to stderr (the log). SIGTERM asks for a graceful stop: the
trainer checkpoints and the process exits with EXIT_INTERRUPTED.

[distributed] Started by torchrun as one of several ranks (jobs/training/ranks/topology.py): rank 0 runs
the night and alone writes events (its result event is the outcome: torchrun's exit status is only
0 or 1); the other ranks follow it (jobs/night/ranks.py) and write only logs. `--join`: a host other
than node 0, whose ranks learn the night and its deadline from rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import ChildEvent, ExitCode, Outcome, ResultEvent, RunSummary, outcome_exit_code
from jobs.contract.redact import redact_text
from jobs.store.files import DamagedState
from jobs.store.locking import LockTimeout, inherited_night_lock, night_lock
from jobs.store.paths import StatePaths

PROCESS_STARTED = time.time()  # the night's "wake": before torch and the model are imported (in main)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.child")
    ap.add_argument("--night")
    ap.add_argument("--deadline", type=float, help="unix seconds")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--run-id", help="the id of a new run (the supervisor logs under it); an open run keeps its own")
    ap.add_argument("--config", help="the night's config (JSON); default: stdin")
    ap.add_argument("--join", action="store_true", help="a host other than node 0: rank 0 says the night")
    ap.add_argument("--start-at", type=float, help="unix seconds: the window's opening; import, then wait for it")
    args = ap.parse_args(argv)
    if not args.join and (args.night is None or args.deadline is None):
        ap.error("--night and --deadline are required (unless --join)")

    from jobs.training.ranks.collectives import bind_device, die_with_parent, init_group, launched

    if launched():
        die_with_parent()  # the launcher SIGKILLed must not leave this worker holding its card
    rank = int(os.environ.get("RANK", "0"))
    owner = rank == 0
    events = os.fdopen(os.dup(1), "w", buffering=1) if owner else None  # one writer of events: rank 0
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the event stream
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def emit(ev: ChildEvent) -> None:
        if events is not None:
            with lock:
                events.write(redact_text(ev.model_dump_json()) + "\n")  # a webhook's secrets stay here

    from jobs.runtime import logs

    logs.configure(os.environ.get("NIGHTSHIFT_LOG_LEVEL", "INFO"))
    if launched():  # [distributed] every log line says which rank wrote it
        structlog.contextvars.bind_contextvars(rank=rank)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the process group: an early SIGTERM must not kill
        signal.signal(sig, lambda *_: stop.set())

    raw = Path(args.config).read_text() if args.config else sys.stdin.read()
    early = json.loads(raw)  # what is needed before the imports; the config is checked after them
    if owner and not args.plan_only:  # the rank that pulls: its workers start, and check, while this one imports
        from jobs.night.intake import start_pull_workers

        start_pull_workers(raw)
    bind_device()  # [distributed] this rank's card, before Unsloth's import looks at CUDA
    _import_unsloth_first(early)
    from jobs.training.ranks.topology import set_cpu_threads

    threads = set_cpu_threads()  # a CPU night: the free cores, not torch's one thread per core
    from jobs.night.config import NightConfig
    from jobs.night.run import failure_text, run_night
    from jobs.runtime.bytecode import warn_if_compiled, without_bytecode

    cfg = NightConfig.model_validate_json(raw)
    logs.route_transformers_logging()
    # the imports' objects live as long as the night: out of the collector's sight, its passes stop walking
    # them (with torch, transformers and peft imported, ~425k objects: an in-process pull of 60,000 records
    # on a 2-core box took 11.7-12.0 s, 10.6-10.9 s frozen)
    gc.freeze()
    # a wake's first leg, prewarmed or not (an 8B's night: 12-33 s, RESULTS.md: 2026-11-26, wake bytecode)
    missing = without_bytecode()  # each such module was compiled from source, and will be every night
    structlog.get_logger("nightshift.night").info("imported", seconds=round(time.time() - PROCESS_STARTED, 1),
                                                  without_bytecode=sum(missing.values()), cpu_threads=threads,
                                                  **({"run_id": args.run_id} if args.run_id else {}))
    warn_if_compiled(missing)
    woke = PROCESS_STARTED
    if args.start_at is not None and not args.plan_only:
        woke = _wait_for_opening(args.start_at, stop, args.run_id)
        if stop.is_set() and time.time() < args.start_at:  # stopped before the window opened: nothing started
            emit(ResultEvent(summary=RunSummary(night=args.night, outcome=Outcome.interrupted,
                                                error="stopped before the window opened")))
            return ExitCode.INTERRUPTED
    group = init_group(cfg.train.distributed)
    try:
        if not group.is_owner:
            from jobs.night.ranks import follow_night

            follow_night(cfg, group, stop)
            return ExitCode.OK
        with contextlib.ExitStack() as held:
            if not args.plan_only and not _holds_night_lock(cfg.state_dir):  # started by hand: take it here
                try:
                    held.enter_context(night_lock(cfg.state_dir, what=f"night {args.night} (child {os.getpid()})"))
                except LockTimeout as e:
                    print(f"nightshift: {e}", file=sys.stderr)
                    return ExitCode.BUSY
            try:
                night = run_night
                if cfg.adapters:  # [[adapters]]: each adapter's night in turn, on one resident base
                    from jobs.night.several.night import run_adapters as night
                summary = night(cfg, night=args.night, deadline=args.deadline, emit=emit, stop=stop,
                                plan_only=args.plan_only, run_id=args.run_id, process_started=woke, group=group)
            except (DamagedState, OSError, sqlite3.Error) as e:  # before a run could open: the model, the ledger
                summary = RunSummary(night=args.night, outcome=Outcome.failed, error=failure_text(e))
                structlog.get_logger("nightshift.night").error("night_refused", error=summary.error)
        emit(ResultEvent(summary=summary))
        return outcome_exit_code(summary.outcome)
    finally:
        try:
            group.release()  # [distributed] rank 0 with nothing handed out frees the waiting ranks
        finally:
            group.close()


def _wait_for_opening(start_at: float, stop: threading.Event, run_id: str | None) -> float:
    """Wait, imports done, until the window opens; the night's wake is then the opening (its first step is
    timed from there), not this process's start. `run_id`: the run the supervisor logs this night under."""
    ready = time.time()
    structlog.get_logger("nightshift.night").info("prewarmed", import_seconds=round(ready - PROCESS_STARTED, 1),
                                                  waits_seconds=round(max(0.0, start_at - ready), 1),
                                                  lead_seconds=round(start_at - PROCESS_STARTED, 1),
                                                  **({"run_id": run_id} if run_id else {}))
    stop.wait(max(0.0, start_at - ready))
    return max(start_at, PROCESS_STARTED)  # an import longer than the lead still counts from the opening


def _holds_night_lock(state_dir: str | Path) -> bool:
    """The night lock came with this process: its own descriptor (started by the daemon), or, for a
    worker of torchrun, the launcher's (torchrun does not pass descriptors on to its workers)."""
    from jobs.training.ranks.collectives import launched

    return inherited_night_lock(Path(state_dir)) or (
        launched() and inherited_night_lock(Path(state_dir), holder_pid=os.getppid()))


def _import_unsloth_first(cfg: dict[str, Any]) -> None:
    """Unsloth patches transformers when imported, so it must come before anything that imports it."""
    import importlib.util

    if cfg.get("train", {}).get("backend", "auto") in ("auto", "unsloth") and importlib.util.find_spec("unsloth"):
        import torch

        if torch.cuda.is_available():
            from jobs.training.backends.unsloth import setup_caches
            from jobs.training.backends.unsloth_import import import_unsloth

            setup_caches(StatePaths(cfg["state_dir"]).models)  # Unsloth reads its cache locations when imported
            import_unsloth()


if __name__ == "__main__":
    sys.exit(main())
