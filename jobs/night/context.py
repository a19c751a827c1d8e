"""One run's context: what every step of the night reads, and the summary they fill in.

A rerun of the same night (after a crash, a kill or a stop) opens the same run again: the
ledger keeps its plan and the checkpoints keep its position, so it resumes where it stopped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from jobs.contract import Emit, Outcome, Phase, PhaseEvent, RunSummary, new_run_id
from jobs.gpu.cards import CardsSampler, night_sampler
from jobs.gpu.telemetry import GpuSampler
from jobs.night.config import NightConfig
from jobs.store.cleanup import close_run, sweep_checkpoints
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from jobs.store.registry import Registry
from jobs.store.stale import close_expired_runs, expired
from jobs.training.ranks.collectives import SOLO, Solo

log = structlog.get_logger("nightshift.night")


@dataclass
class RunContext:
    cfg: NightConfig
    ledger: Ledger
    registry: Registry
    emit: Emit
    clock: Callable[[], float]
    stop: threading.Event
    night: str
    deadline: float  # unix seconds training must have stopped and saved by (the window's end - save margin)
    run_id: str
    model_path: Path
    fingerprint: str  # of the base model (manifests, throughput key)
    summary: RunSummary
    resumed: bool = False  # the run was opened before: its stored plan and checkpoints are used
    plan_only: bool = False  # `nightshift plan`: nothing is recorded
    parent: int | None = None  # the version in service a new plan continues from (checked by the night)
    gpu: GpuSampler | CardsSampler | None = None
    process_started: float | None = None  # when the child process started (wake -> first step)
    group: Solo = SOLO  # [distributed] the night's ranks: this process is rank 0 (jobs/night/ranks.py)
    _measures: Ledger | None = None  # [[adapters]]: the shared directory's ledger (opened when first asked)

    @property
    def state(self) -> Path:
        return Path(self.cfg.state_dir)

    @property
    def shared(self) -> Path:
        """Where what every adapter shares lives: the base model's caches, the measured throughput
        ([[adapters]]: the top state directory; otherwise this run's own)."""
        return Path(self.cfg.shared_dir or self.cfg.state_dir)

    @property
    def measures(self) -> Ledger:
        """The ledger of throughput and calibration: one per base and method, shared by the adapters."""
        if self.cfg.shared_dir is None:
            return self.ledger
        if self._measures is None:
            path = StatePaths(self.shared).ledger
            self._measures = open_read_only(path, clock=self.clock) if self.plan_only else Ledger(path,
                                                                                                  clock=self.clock)
        return self._measures

    def close_measures(self) -> None:
        if self._measures is not None:
            self._measures.close()
            self._measures = None

    @property
    def checkpoints(self) -> Path:
        return StatePaths(self.state).run_checkpoints(self.run_id)

    @contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        started = self.clock()
        self.emit(PhaseEvent(phase=name, state="start"))
        try:
            yield
        finally:
            secs = self.clock() - started
            if not self.plan_only:
                self.ledger.record_phase(self.run_id, name.value, started, secs)
            self.summary.phase_seconds[name.value] = self.summary.phase_seconds.get(name.value, 0.0) + secs
            self.emit(PhaseEvent(phase=name, state="end", seconds=secs))

    def free_vram_gb(self) -> float | None:
        """The card's free memory now (NVML; None without a card or with [gpu] enabled = false)."""
        if not self.cfg.gpu.enabled:
            return None
        from jobs.gpu import telemetry as gpu

        return gpu.free_vram_gb(gpu.torch_device_uuid() or self.cfg.gpu.device)

    def start_gpu(self) -> None:
        if not self.cfg.gpu.enabled:
            return
        # [distributed] the cards of this host's ranks, summed; the other ranks' peak memory added
        self.gpu = night_sampler(self.emit, self.cfg.gpu, others_peak=lambda: self.group.others_peak,
                                 local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.group.world > 1
                                 else 1)
        if not self.gpu.start():
            self.gpu = None  # no GPU here: the GPU figures stay absent

    def stop_gpu(self) -> None:
        """Close the run's GPU telemetry: the summary gets power, energy and peak memory."""
        if self.gpu is not None:
            self.summary.gpu = self.gpu.stop()
            self.gpu = None

    def finish(self, outcome: str, error: str | None = None) -> None:
        """Close the run in the ledger with its summary (the night counts as done)."""
        self.summary.outcome = Outcome(outcome)
        self.summary.error = error
        close_run(self.ledger, self.run_id, outcome, summary=self.summary, error=error)


def open_context(cfg: NightConfig, *, model_path: Path, fingerprint: str, night: str, deadline: float, emit: Emit,
                 stop: threading.Event, clock: Callable[[], float], plan_only: bool,
                 run_id: str | None = None, process_started: float | None = None, group: Solo = SOLO) -> RunContext:
    """Open tonight's run in the ledger (or reopen the one a crash or stop left open). `run_id`: the id a
    new run gets (the supervisor chose it to log under); a plan opens the ledger read-only.
    `process_started`: when the child process started (wake -> first step). `group`: the night's ranks."""
    state = Path(cfg.state_dir)
    ledger = open_read_only(StatePaths(state).ledger, clock=clock) if plan_only else Ledger(StatePaths(state).ledger,
                                                                                          clock=clock)
    if not plan_only:  # a run whose window ended is closed (its samples pending again), never resumed later
        close_expired_runs(ledger, clock())
    open_run = ledger.open_run(night)
    if open_run is not None and plan_only and expired(open_run, clock()):
        open_run = None  # the next night closes it and plans afresh, as this plan does
    if open_run is not None:  # a plan shows what a start now would resume: its stored plan, the time left now
        run_id = str(open_run["id"])  # (a plan that planned afresh showed other samples and another version)
        if not plan_only:
            attempt = ledger.resume_run(run_id, deadline)
            ledger.add_event("resumed", run_id=run_id, detail={"attempt": attempt, "deadline": deadline})
            log.info("resuming_run", run_id=run_id, attempt=attempt)
    else:
        run_id = run_id or new_run_id("plan" if plan_only else night)
        if not plan_only:
            ledger.start_run(run_id, night, deadline)
    if not plan_only:
        sweep_checkpoints(ledger)  # runs closed by anyone (a supervisor giving up, a crash) leave none behind
    structlog.contextvars.bind_contextvars(run_id=run_id)
    summary = RunSummary(run_id=run_id, night=night, deadline=deadline, started_at=clock(),
                         base_model=str(model_path))
    return RunContext(cfg=cfg, ledger=ledger, registry=Registry(state, create=not plan_only), emit=emit,
                      clock=clock, stop=stop,
                      night=night, deadline=deadline, run_id=run_id, model_path=model_path,
                      fingerprint=fingerprint, summary=summary,
                      resumed=open_run is not None, plan_only=plan_only, process_started=process_started,
                      group=group)
