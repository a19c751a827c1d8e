"""NVML telemetry of a night that uses several cards: one GpuSampler per card, one summed event per tick.

Why sums: a night on N cards draws the power and uses the energy and memory of all of them; the
planner and the manifest want the night's joules per token, whatever the count. Each event also
carries every card's own reading (`cards`), which the daemon exports with a `gpu` label, so one hot
or full card is not hidden in a total. Utilisation is the cards' mean, temperature their maximum.

Rank 0 samples the cards of its own host (the daemon's host); cards on other hosts of a
`[train.distributed]` night are not sampled (their peak memory still reaches the summary through
the training group). One card: the plain GpuSampler, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jobs.contract import Emit, GpuCardReading, GpuEvent, GpuSummary
from jobs.gpu.telemetry import AUTO, GpuConfig, GpuSampler, PeakMemory, torch_device_uuid, torch_peak_memory


def _sum(xs: Sequence[float | int | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) if vals else None


class CardsSampler:
    """Samples `devices` (NVML indices or UUIDs) at `hz` and emits their totals; same interface as GpuSampler."""

    def __init__(self, emit: Emit | None, *, devices: Sequence[int | str], labels: Sequence[str], hz: float = 1.0,
                 nvml: Any = AUTO, clock: Callable[[], float] = time.time,
                 peak_memory: PeakMemory | None = None) -> None:
        self.emit, self.hz, self.clock, self.peak_memory = emit, hz, clock, peak_memory
        self.cards = [(label, GpuSampler(None, hz=hz, device=d, nvml=nvml, clock=clock))
                      for d, label in zip(devices, labels, strict=True)]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, background: bool = True) -> bool:
        """Open every card; False when none could be (then nothing is sampled, as without a GPU)."""
        self.cards = [(label, s) for label, s in self.cards if s.start(background=False)]
        if not self.cards:
            return False
        self._emit([s.sample() for _, s in self.cards])
        if background:
            self._thread = threading.Thread(target=self._loop, name="gpu-cards-sampler", daemon=True)
            self._thread.start()
        return True

    def _loop(self) -> None:
        while not self._stop.wait(1.0 / self.hz):
            self.sample()

    def sample(self) -> GpuEvent | None:
        return self._emit([s.sample() for _, s in self.cards])

    def _emit(self, readings: list[GpuEvent | None]) -> GpuEvent | None:
        got = [(label, r) for (label, _), r in zip(self.cards, readings, strict=True) if r is not None]
        if not got:
            return None
        utils = [r.utilization_ratio for _, r in got if r.utilization_ratio is not None]
        temps = [r.temperature_celsius for _, r in got if r.temperature_celsius is not None]
        vram_used, vram_total = _sum([r.vram_used_bytes for _, r in got]), _sum([r.vram_total_bytes for _, r in got])
        event = GpuEvent(
            ts=self.clock(), power_watts=_sum([r.power_watts for _, r in got]),
            energy_joules_total=_sum([r.energy_joules_total for _, r in got]),
            vram_used_bytes=int(vram_used) if vram_used is not None else None,
            vram_total_bytes=int(vram_total) if vram_total is not None else None,
            utilization_ratio=sum(utils) / len(utils) if utils else None, temperature_celsius=max(temps, default=None),
            cards=[GpuCardReading(gpu=label, power_watts=r.power_watts, vram_used_bytes=r.vram_used_bytes,
                                  vram_total_bytes=r.vram_total_bytes, utilization_ratio=r.utilization_ratio,
                                  temperature_celsius=r.temperature_celsius) for label, r in got])
        if self.emit is not None:
            self.emit(event)
        return event

    def stop(self) -> GpuSummary | None:
        """The night's figures over all its cards: energy and mean power summed, memory summed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        summaries = [s for _, s in ((label, smp.stop()) for label, smp in self.cards) if s is not None]
        if not summaries:
            return None
        names = sorted({s.name for s in summaries})
        peak = self.peak_memory() if self.peak_memory is not None else None
        total = _sum([s.total_memory_bytes for s in summaries])
        return GpuSummary(
            mean_power_watts=_sum([s.mean_power_watts for s in summaries]),
            energy_joules=_sum([s.energy_joules for s in summaries]),
            peak_allocated_bytes=peak[0] if peak else None, peak_reserved_bytes=peak[1] if peak else None,
            total_memory_bytes=int(total) if total is not None else None,
            name=f"{len(summaries)}x {names[0]}" if len(names) == 1 else ", ".join(names))


def night_sampler(emit: Emit, cfg: GpuConfig, *, local_ranks: int = 1,
                  others_peak: Callable[[], tuple[int, int] | None] = lambda: None) -> GpuSampler | CardsSampler:
    """Rank 0's sampler: its own card (as always), or every card of its host the night's ranks use.
    Peak memory is rank 0's own plus the other ranks' (`others_peak`, summed by the training group)."""
    def peak() -> tuple[int, int] | None:
        mine, theirs = torch_peak_memory(), others_peak()
        if mine is None or theirs is None:
            return mine
        return mine[0] + theirs[0], mine[1] + theirs[1]

    if local_ranks <= 1:
        return GpuSampler(emit, hz=cfg.sample_hz, device=torch_device_uuid() or cfg.device, peak_memory=peak)
    import os

    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    labels = [visible[i] if i < len(visible) else str(i) for i in range(local_ranks)]
    devices: list[int | str] = [torch_device_uuid(i) or int(label) for i, label in enumerate(labels)]
    return CardsSampler(emit, devices=devices, labels=labels, hz=cfg.sample_hz, peak_memory=peak)
