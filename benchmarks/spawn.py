"""One benchmark worker in a process of its own (`python -m benchmarks worker`): the settings go on its
stdin, its rows into the rows file; its exit frees every byte of VRAM it used."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.settings import BenchSettings


def spawn(stack: str, s: BenchSettings, model: Path, rows: Path, timeout: float | None) -> int:
    """One worker process for `stack`; its exit code (124: timed out)."""
    argv = [sys.executable, "-m", "benchmarks", "worker", "--stack", stack, "--model", str(model),
            "--rows", str(rows), "--t-launch", repr(time.time())]
    print(f"--- {stack}: {' '.join(argv[3:])}", flush=True)
    try:
        return subprocess.run(argv, input=s.model_dump_json(), text=True, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"--- {stack}: timed out after {timeout:.0f} s", flush=True)
        return 124
