"""One preference night in a process forked from a forkserver that imported the night once
(tests/preference/test_dpo_resume.py): `night(root, crash_at)` runs the night of ROOT/night.json, optionally with
NIGHTSHIFT_CRASH_AT set (the crash point SIGKILLs it), and writes its summary to ROOT/summary.json."""

from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path

import torch

import jobs.night.run  # noqa: F401  (torch, transformers, every crash point: imported once, before the forks)

NIGHT = "2026-11-21"


def night(root: str, crash_at: str | None) -> None:
    from jobs.contract import crashpoints
    from jobs.night.config import NightConfig
    from jobs.night.run import run_night

    torch.set_num_threads(1)
    torch.manual_seed(0)
    crashpoints._counts.clear()
    if crash_at is None:
        os.environ.pop(crashpoints.ENV, None)
    else:
        os.environ[crashpoints.ENV] = crash_at
    out = Path(root)
    try:
        cfg = NightConfig.model_validate_json((out / "night.json").read_text())
        summary = run_night(cfg, night=NIGHT, deadline=time.time() + 3600, emit=lambda ev: None,
                            stop=threading.Event())
        (out / "summary.json").write_text(summary.model_dump_json())
    except BaseException:
        (out / "error.txt").write_text(traceback.format_exc())
        raise
