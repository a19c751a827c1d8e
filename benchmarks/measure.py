"""What a worker measures: the timed window (tok/s, samples/h, NVML energy over exactly it) and peaks.

Worker side: torch is imported inside the functions that need CUDA. `smi_log` is the parent's
(an nvidia-smi process beside the workers, touching no CUDA itself).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jobs.contract import GpuEvent, GpuSummary
from jobs.data.batching import TokenizedSample


class Window:
    """Timed window: steps after warm-up until max_steps or seconds; NVML energy over exactly it."""

    def __init__(
        self,
        *,
        warmup: int,
        max_steps: int,
        seconds: float,
        hz: float = 10.0,
        on_gpu_event: Callable[[GpuEvent], None] | None = None,
    ) -> None:
        self.warmup, self.max_steps, self.seconds, self.hz = warmup, max_steps, seconds, hz
        self.on_gpu_event = on_gpu_event
        self.steps = 0
        self.timed: list[tuple[float, int, int]] = []  # (seconds, real tokens, samples)
        self.t_start: float | None = None
        self.sampler: Any = None
        self.gpu: GpuSummary | None = None
        self.first_step_end: float | None = None  # time.time() after the first step, warm-up included
        self.t_end: float | None = None

    def step_done(self, seconds: float, tokens: int, samples: int) -> bool:
        """Record one step; True when the window is complete."""
        self.steps += 1
        if self.first_step_end is None:
            self.first_step_end = time.time()
        if self.steps == self.warmup:
            self._begin()
            return False
        if self.steps > self.warmup:
            self.timed.append((seconds, tokens, samples))
            done = len(self.timed) >= self.max_steps or time.perf_counter() - (self.t_start or 0) >= self.seconds
            if done:
                self._end()
            return done
        return False

    # what jobs.training.probe.timed_steps calls (StepWindow): calibrate's window, watched from here
    def begin(self) -> None:
        self._begin()

    def record(self, seconds: float, tokens: int, samples: int) -> None:
        self.steps += 1
        self.timed.append((seconds, tokens, samples))

    def end(self) -> None:
        self._end()

    def _begin(self) -> None:
        import torch

        from jobs.gpu.telemetry import GpuSampler

        torch.cuda.synchronize()
        self.sampler = GpuSampler(self.on_gpu_event, hz=self.hz)
        if not self.sampler.start():
            self.sampler = None
        self.t_start = time.perf_counter()

    def _end(self) -> None:
        if self.t_end is None:
            import torch

            if torch.cuda.is_available():  # train_step returns before the GPU has run the step (jobs/training/step.py)
                torch.cuda.synchronize()
            self.t_end = time.perf_counter()
        if self.sampler is not None:
            self.gpu = self.sampler.stop()
            self.sampler = None

    def first_step_s(self, t_launch: float) -> float | None:
        """Seconds from the worker's launch to the end of its first step."""
        return round(self.first_step_end - t_launch, 1) if self.first_step_end else None

    def result(self, data: Sequence[TokenizedSample] | None = None) -> dict[str, Any]:
        """The window's figures. samples/h is the token rate over `data`'s mean sample length (the data
        set the steps were drawn from), not the window's own sample count: a window is a few steps, and
        ours fills its rows best-fit from a lookahead, so its first steps do not hold the data set's mix
        of lengths and their count is not what a whole night trains an hour (Qwen3-32B, 861-token
        profile: 1,225 tokens a sample in a 12-step window). The window's own count stays in
        window_samples_per_hour."""
        if self.sampler is not None:
            self._end()
        step_secs = sum(t for t, _, _ in self.timed)
        secs = (self.t_end - self.t_start) if self.t_end and self.t_start else step_secs  # wall clock
        toks = sum(n for _, n, _ in self.timed)
        samples = sum(s for _, _, s in self.timed)
        tok_s = toks / secs if secs else None
        lengths = [x.n_tokens for x in data or () if x.n_tokens > 0]
        window_sph = samples / secs * 3600 if secs else None
        sph = tok_s * 3600 / (sum(lengths) / len(lengths)) if lengths and tok_s is not None else window_sph
        g = self.gpu
        joules = g.energy_joules if g else None
        return {
            "timed_steps": len(self.timed),
            "timed_seconds": round(secs, 3),
            "step_seconds_sum": round(step_secs, 3),
            "real_tokens": toks,
            "samples": samples,
            "tokens_per_step": round(toks / max(1, len(self.timed)), 1),
            "real_tok_s": tok_s,
            "samples_per_hour": sph,
            "window_samples_per_hour": window_sph,
            "energy_joules": joules,
            "mean_power_w": g.mean_power_watts if g else None,
            "j_per_1k_tok": joules / toks * 1000 if joules and toks else None,
            "gpu_name": g.name if g else None,
            "thirds_tok_s": self.thirds(),
        }

    def thirds(self) -> list[float] | None:
        """tok/s of the window's first, middle and last third of steps (step time): a rate still climbing
        inside the window shows here (an 8B's FP8 steps on an H200: 18,313 / 20,322 / 20,478)."""
        n = len(self.timed) // 3
        if n < 2:
            return None
        parts = (self.timed[:n], self.timed[n:2 * n], self.timed[2 * n:])
        return [round(sum(k for _, k, _ in part) / sum(t for t, _, _ in part), 1) for part in parts]


def peak_gb() -> dict[str, float]:
    """torch's peak allocated / reserved memory since the last reset, in GB."""
    import torch

    return {
        "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
    }


@contextlib.contextmanager
def smi_log(path: Path | None, fields: str) -> Iterator[None]:
    """While the workers run: nvidia-smi readings (CSV, every 500 ms) into `path`; nothing without a path."""
    if path is None:
        yield
        return
    with open(path, "w") as f:
        smi = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,nounits", "-lms", "500"],
            stdout=f,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield
        finally:
            smi.terminate()
            smi.wait(10)


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One result row: appended to the rows file (JSON lines) and printed."""
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print("ROW", json.dumps(row, default=str), flush=True)
