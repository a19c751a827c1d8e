"""The night's child process: `python -m jobs.night.child --night N --deadline TS < night-config.json`.

The daemon never imports torch; this process does, and its exit returns every byte
of VRAM. Events go out as JSON lines on the original stdout; anything else a library
prints is redirected to stderr (the log). SIGTERM asks for a graceful stop: the
trainer checkpoints and the process exits with EXIT_INTERRUPTED.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from jobs.contract import ChildEvent, ResultEvent, outcome_exit_code

PROCESS_STARTED = time.time()  # the night's "wake": before torch and the model are imported (in main)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.child")
    ap.add_argument("--night", required=True)
    ap.add_argument("--deadline", type=float, required=True, help="unix seconds")
    ap.add_argument("--plan-only", action="store_true")
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
    from jobs.night.run import run_night

    cfg = NightConfig.model_validate_json(raw)
    logs.route_transformers_logging()
    summary = run_night(cfg, night=args.night, deadline=args.deadline, emit=emit, stop=stop,
                        plan_only=args.plan_only, process_started=PROCESS_STARTED)
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
