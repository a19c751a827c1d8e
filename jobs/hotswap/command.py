"""Command target: run `argv + [adapter path]` (no shell), exit 0 = success.

The command also finds NIGHTSHIFT_ADAPTER_NAME / _VERSION / _PATH / NIGHTSHIFT_BASE_MODEL and
NIGHTSHIFT_METHOD (qlora | lora: the path is a LoRA adapter; full: a whole model directory) in
its environment. It runs in its own process group: on timeout the whole group gets SIGTERM,
then SIGKILL after a short grace, so a script's children do not outlive it. The tail of its
merged stdout/stderr goes into the outcome (and so the log and the ledger).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any

from jobs.hotswap.config import CommandTarget
from jobs.hotswap.core import AdapterRef, Clock, HotswapOutcome, Sleep, TargetError, with_retries

TAIL_CHARS = 2000
KILL_GRACE_S = 3.0  # between SIGTERM and SIGKILL


def _tail(out: bytes | None) -> str:
    return (out or b"").decode("utf-8", "replace")[-TAIL_CHARS:]


def _kill_group(proc: subprocess.Popen[bytes]) -> bytes:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            out, _ = proc.communicate(timeout=wait)
            return out or b""
        except subprocess.TimeoutExpired:
            continue
    return b""


def run(
    t: CommandTarget,
    adapter: AdapterRef,
    *,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any,
) -> HotswapOutcome:
    argv = [*t.argv, str(adapter.path)]
    env = {
        **os.environ,
        "NIGHTSHIFT_ADAPTER_NAME": adapter.name,
        "NIGHTSHIFT_ADAPTER_VERSION": str(adapter.version),
        "NIGHTSHIFT_ADAPTER_PATH": str(adapter.path),
        "NIGHTSHIFT_BASE_MODEL": adapter.base_model,
        "NIGHTSHIFT_METHOD": adapter.method.value,  # full: the path is a whole model directory
    }

    def attempt(_: int) -> dict[str, Any]:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as e:  # not found, not executable: retrying will not help
            raise TargetError(f"cannot run {argv[0]}: {e.strerror or e}", retryable=False) from e
        try:
            out, _ = proc.communicate(timeout=t.timeout_s)
        except subprocess.TimeoutExpired:
            out = _kill_group(proc)
            raise TargetError(
                f"{argv[0]} timed out after {t.timeout_s:g} s and was killed",
                retryable=True,
                detail={"pid": proc.pid, "output_tail": _tail(out)},
            ) from None
        detail = {"argv": argv, "returncode": proc.returncode, "pid": proc.pid, "output_tail": _tail(out)}
        if proc.returncode != 0:
            raise TargetError(f"{argv[0]} exited with status {proc.returncode}", retryable=True, detail=detail)
        return detail

    return with_retries(
        attempt, target=t.name, kind=t.kind, retries=t.retries, backoff_s=t.backoff_s, sleep=sleep, clock=clock, log=log
    )
