"""The night's child process: `python -m jobs.night.child --night N --deadline TS < night-config.json`
(or `--config FILE`: under torchrun every worker shares the launcher's stdin, so the config comes as a file).

The daemon never imports torch; this process does, and its exit returns every byte
of VRAM. Events go out as JSON lines on the original stdout; anything else a library
prints is redirected to stderr (the log). SIGTERM asks for a graceful stop: the
trainer checkpoints and the process exits with EXIT_INTERRUPTED.

[distributed] Started by torchrun as one of several ranks (jobs/training/topology.py): rank 0 runs
the night and alone writes events (its result event is the outcome: torchrun's exit status is only
0 or 1); the other ranks follow it (jobs/night/ranks.py) and write only logs. `--join`: a host other
than node 0, whose ranks learn the night and its deadline from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from jobs.contract import ChildEvent, ExitCode, ResultEvent, outcome_exit_code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.child")
    ap.add_argument("--night")
    ap.add_argument("--deadline", type=float, help="unix seconds")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--config", help="the night's config (JSON); default: stdin")
    ap.add_argument("--join", action="store_true", help="a host other than node 0: rank 0 says the night")
    args = ap.parse_args(argv)
    if not args.join and (args.night is None or args.deadline is None):
        ap.error("--night and --deadline are required (unless --join)")

    from jobs.training.distributed import bind_device, die_with_parent, init_group, launched

    if launched():
        die_with_parent()  # the launcher SIGKILLed must not leave this worker holding its card
    owner = int(os.environ.get("RANK", "0")) == 0
    events = os.fdopen(os.dup(1), "w", buffering=1) if owner else None  # one writer of events: rank 0
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the event stream
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def emit(ev: ChildEvent) -> None:
        if events is not None:
            with lock:
                events.write(ev.model_dump_json() + "\n")

    from jobs import logs

    logs.configure(os.environ.get("NIGHTSHIFT_LOG_LEVEL", "INFO"))
    if launched():  # [distributed] every log line says which rank wrote it
        import structlog

        structlog.contextvars.bind_contextvars(rank=int(os.environ.get("RANK", "0")))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the process group: an early SIGTERM must not kill
        signal.signal(sig, lambda *_: stop.set())

    raw = Path(args.config).read_text() if args.config else sys.stdin.read()
    bind_device()  # [distributed] this rank's card, before Unsloth's import looks at CUDA
    _import_unsloth_first(json.loads(raw))
    from jobs.night.config import NightConfig

    cfg = NightConfig.model_validate_json(raw)
    logs.route_transformers_logging()
    group = init_group(cfg.train.distributed)
    try:
        if not group.is_owner:
            from jobs.night.ranks import follow_night

            follow_night(cfg, group, stop)
            return ExitCode.OK
        from jobs.night.run import run_night

        summary = run_night(cfg, night=args.night, deadline=args.deadline, emit=emit, stop=stop,
                            plan_only=args.plan_only, group=group)
        emit(ResultEvent(summary=summary))
        return outcome_exit_code(summary.outcome)
    finally:
        try:
            group.release()  # [distributed] rank 0 with nothing handed out frees the waiting ranks
        finally:
            group.close()


def _import_unsloth_first(cfg: dict[str, Any]) -> None:
    """Unsloth patches transformers when imported, so it must come before anything that imports it."""
    import importlib.util

    if cfg.get("train", {}).get("backend", "auto") in ("auto", "unsloth") and importlib.util.find_spec("unsloth"):
        import torch

        if torch.cuda.is_available():
            import unsloth  # noqa: F401


if __name__ == "__main__":
    sys.exit(main())
