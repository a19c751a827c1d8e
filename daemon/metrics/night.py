"""The night as series: the child's events, its RunSummary and the daemon's own facts, turned into
the catalogued values.

Why this shape:
- One registry passed in (tests use a fresh `CollectorRegistry()`), no multiprocess mode: the
  child's figures reach the daemon as typed contract events over the supervisor's pipe, and
  `on_event` / `on_summary` turn them into series here.
- Unknown is absent, not zero (see exporter.py); counters that are meaningful at 0 are pre-set.
- The energy counter adds only positive deltas of the card's running total: a new child, a
  counter reset or a long gap re-baselines instead of adding the card's whole history.
"""

from __future__ import annotations

import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from daemon.metrics import catalog as m  # every series is named as m.<CONSTANT>
from daemon.metrics.exporter import _Values
from jobs.contract import (
    ChildEvent,
    GpuEvent,
    GpuSummary,
    HotswapEvent,
    Method,
    Outcome,
    PhaseEvent,
    ProgressEvent,
    ResultEvent,
    RunSummary,
    nightshift_version,
)
from jobs.gpu.cost import summary_cost

# series that describe the running child: absent once it is gone
LIVE_GPU = (m.GPU_POWER_WATTS, m.GPU_MEMORY_USED_BYTES, m.GPU_UTILIZATION_RATIO, m.GPU_TEMPERATURE_CELSIUS)
# GpuEvent field -> series
GPU_EVENT_GAUGES = {
    "power_watts": m.GPU_POWER_WATTS,
    "vram_used_bytes": m.GPU_MEMORY_USED_BYTES,
    "vram_total_bytes": m.GPU_MEMORY_TOTAL_BYTES,
    "utilization_ratio": m.GPU_UTILIZATION_RATIO,
    "temperature_celsius": m.GPU_TEMPERATURE_CELSIUS,
}
# GpuCardReading field -> per-card series (label gpu)
GPU_CARD_GAUGES = {
    "power_watts": m.GPU_CARD_POWER_WATTS,
    "vram_used_bytes": m.GPU_CARD_MEMORY_USED_BYTES,
    "utilization_ratio": m.GPU_CARD_UTILIZATION_RATIO,
    "temperature_celsius": m.GPU_CARD_TEMPERATURE_CELSIUS,
}
# GpuSummary field -> series
SUMMARY_GPU_GAUGES = {
    "mean_power_watts": m.LAST_RUN_GPU_MEAN_POWER_WATTS,
    "energy_joules": m.LAST_RUN_GPU_ENERGY_JOULES,
    "peak_allocated_bytes": m.LAST_RUN_GPU_PEAK_ALLOCATED_BYTES,
    "peak_reserved_bytes": m.LAST_RUN_GPU_PEAK_RESERVED_BYTES,
}
# counters that exist (at 0) from the daemon's start
ZERO_AT_START = (
    m.TRAINED_TOKENS_TOTAL,
    m.TRAINED_SAMPLES_TOTAL,
    m.INGESTED_FILES_TOTAL,
    m.DUPLICATE_SAMPLES_TOTAL,
    m.ADAPTER_VERSIONS_PUBLISHED_TOTAL,
    m.RUN_IN_PROGRESS,
    m.SAMPLES_RETURNED_TOTAL,
    m.SAMPLES_SET_ASIDE_TOTAL,
)
COMPLETED = (Outcome.succeeded, Outcome.rejected)  # an interrupted run's time says nothing of the plan


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


class NightshiftMetrics:
    """Every nightshift series, fed by the child's events, its RunSummary and the daemon's own facts.

    Thread-safe: events arrive on the supervisor's reader thread, scrapes on the HTTP server's.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.time,
        sources: Iterable[str] = (),
        hotswap_kinds: Iterable[str] = (),
        energy_gap_seconds: float = 120.0,
        version: str | None = None,
        price_per_gpu_hour: float | None = None,
    ) -> None:
        self.clock = clock
        self.price_per_gpu_hour = price_per_gpu_hour  # [gpu]: the last run's dollars per million tokens
        self.energy_gap_seconds = energy_gap_seconds
        self.values = _Values(s for s in m.SPECS if s.kind != m.HISTOGRAM)
        registry.register(self.values)
        duration = m.BY_NAME[m.RUN_DURATION_SECONDS]
        self.run_duration = Histogram(duration.name, duration.help, buckets=duration.buckets, registry=registry)
        self._lock = threading.RLock()
        self._high_water: dict[int, tuple[int, int]] = {}  # version -> (tokens, samples) already counted
        self._published: set[int] = set()
        self._seen: deque[tuple[Any, ...]] = deque(maxlen=32)  # summaries already counted
        self._energy_last: float | None = None
        self._energy_ts = 0.0
        self._window_end: float | None = None
        self._run_window_end: float | None = None
        v = self.values
        for outcome in m.OUTCOMES:
            v.set(m.RUNS_TOTAL, 0, outcome=outcome)
        for reason in m.QUARANTINE_REASONS:
            v.set(m.QUARANTINED_SAMPLES_TOTAL, 0, reason=reason)
        for source in sources:
            v.set(m.INGESTED_SAMPLES_TOTAL, 0, source=source)
        for kind in hotswap_kinds:
            self._init_hotswap(kind)
        for name in ZERO_AT_START:
            v.set(name, 0)
        v.set(m.BUILD_INFO, 1, version=version or nightshift_version(), python_version=platform.python_version())

    # ---- the child's events -------------------------------------------------------------
    def on_event(self, event: ChildEvent) -> None:
        """One typed event from the child (validated where the pipe is read); plan and OOM-split
        events carry nothing for the series."""
        if isinstance(event, ResultEvent):
            self.on_summary(event.summary)
            return
        if isinstance(event, HotswapEvent):
            self.on_hotswap(event.outcome.kind, event.outcome.ok)
            return
        if not isinstance(event, PhaseEvent | ProgressEvent | GpuEvent):
            return
        with self._lock:
            self._begin_run()
            if isinstance(event, PhaseEvent):
                self._on_phase(event)
            elif isinstance(event, ProgressEvent):
                self._on_progress(event)
            else:
                self._on_gpu(event)

    def _begin_run(self) -> None:
        if not self.values.get(m.RUN_IN_PROGRESS):
            self.values.set(m.RUN_IN_PROGRESS, 1)
            self._run_window_end = self._window_end

    def _on_phase(self, ev: PhaseEvent) -> None:
        if ev.state == "start":
            self.values.clear(m.RUN_PHASE)
            self.values.set(m.RUN_PHASE, 1, phase=ev.phase.value)
        else:
            self.values.set(m.RUN_PHASE, None, phase=ev.phase.value)

    def _on_progress(self, ev: ProgressEvent) -> None:
        v = self.values
        v.set(m.RUN_PROGRESS_RATIO, ev.fraction)
        v.set(m.LAST_RUN_STEPS, ev.steps)
        v.set(m.LAST_RUN_TOKENS_PER_SECOND, ev.tokens_per_second)
        self._count_trained(ev.version, ev.tokens, ev.samples)

    def _count_trained(self, version: int | None, tokens: int, samples: int) -> None:
        """Counters follow the run's cumulative figures: a resumed run restarts from its checkpoint's."""
        seen_tokens, seen_samples = self._high_water.get(version, (0, 0)) if version is not None else (0, 0)
        self.values.inc(m.TRAINED_TOKENS_TOTAL, max(0, tokens - seen_tokens))
        self.values.inc(m.TRAINED_SAMPLES_TOTAL, max(0, samples - seen_samples))
        if version is not None:
            self._high_water[version] = (max(tokens, seen_tokens), max(samples, seen_samples))

    def _on_gpu(self, ev: GpuEvent) -> None:
        for key, name in GPU_EVENT_GAUGES.items():
            if key == "vram_total_bytes" and ev.vram_total_bytes is None:
                continue  # the card's size stays known between runs
            self.values.set(name, _num(getattr(ev, key)))
        for card in ev.cards:  # a night on several cards: each one's own reading
            for key, name in GPU_CARD_GAUGES.items():
                self.values.set(name, _num(getattr(card, key)), gpu=card.gpu)
        energy = _num(ev.energy_joules_total)
        if energy is None:
            return
        ts = float(ev.ts)
        last = self._energy_last
        if last is not None and energy >= last and ts - self._energy_ts <= self.energy_gap_seconds:
            self.values.inc(m.GPU_ENERGY_JOULES_TOTAL, energy - last)
        else:  # first reading of a child, a counter reset or a gap: re-baseline, add nothing
            self.values.setdefault(m.GPU_ENERGY_JOULES_TOTAL, 0.0)
        self._energy_last, self._energy_ts = energy, ts

    def on_child_start(self) -> None:
        """A night's child was started: it runs from now (its first event comes after its imports)."""
        with self._lock:
            self._begin_run()

    def on_child_exit(self) -> None:
        """The child is gone (finished, crashed or killed): live series become absent."""
        with self._lock:
            self._end_run()

    def _end_run(self) -> None:
        v = self.values
        v.clear(m.RUN_PHASE)
        v.set(m.RUN_PROGRESS_RATIO, None)
        for name in LIVE_GPU:
            v.set(name, None)
        for name in GPU_CARD_GAUGES.values():
            v.clear(name)
        self._energy_last = None
        v.set(m.RUN_IN_PROGRESS, 0)  # last: a scrape that reads 0 finds the live series gone too

    # ---- the RunSummary -----------------------------------------------------------------
    def on_summary(self, s: RunSummary) -> None:
        """A finished run. Unknown figures stay absent, so a crash can be reported as
        `RunSummary(outcome="failed", ended_at=ts)`; the same summary twice counts once."""
        key = (s.run_id, s.started_at, s.ended_at, s.outcome)
        with self._lock:
            if key in self._seen:
                return
            self._seen.append(key)
            self._summary(s)
            self._end_run()

    def _summary(self, s: RunSummary) -> None:
        v = self.values
        ended = s.ended_at or float(self.clock())
        v.inc(m.RUNS_TOTAL, outcome=s.outcome.value)
        if s.started_at is not None and ended >= s.started_at:
            self.run_duration.observe(ended - s.started_at)
        end_limit = self._run_window_end or self._window_end or s.deadline
        self._run_window_end = None
        self._last_run(s, ended, end_limit)
        # counters: training and data
        self._count_trained(s.version, s.trained_tokens, s.trained_samples)
        v.inc(m.PREFERENCE_PAIRS_TRAINED_TOTAL, s.preference_pairs)
        v.inc(m.SAMPLES_RETURNED_TOTAL, s.returned_samples)
        v.inc(m.SAMPLES_SET_ASIDE_TOTAL, s.set_aside_samples)
        # data
        for source, n in s.ingested.items():
            v.inc(m.INGESTED_SAMPLES_TOTAL, n, source=source)
        for reason, n in s.quarantined.items():
            v.inc(m.QUARANTINED_SAMPLES_TOTAL, n, reason=reason)
        v.inc(m.INGESTED_FILES_TOTAL, s.files_ingested)
        v.inc(m.DUPLICATE_SAMPLES_TOTAL, s.duplicates)
        # adapters
        version = s.version
        if version is not None and s.adapter_path and s.outcome in COMPLETED and version not in self._published:
            self._published.add(version)
            v.inc(m.ADAPTER_VERSIONS_PUBLISHED_TOTAL)
        if s.promoted and version is not None:
            self.set_adapter_in_service(version, s.version_name or str(version), s.base_model,
                                        (s.method or Method.qlora).value)

    def _answers(self, s: RunSummary) -> None:
        """Exact match and reply token accuracy of every model the gate compared; the regression set's size."""
        v = self.values
        v.clear(m.LAST_RUN_EXACT_MATCH_RATIO)
        v.clear(m.LAST_RUN_TOKEN_ACCURACY_RATIO)
        for stage, model in m.EVAL_MODELS.items():
            for data in m.EVAL_DATA:
                figures = s.metrics.get(f"{data}_{stage}") or {}
                v.set(m.LAST_RUN_EXACT_MATCH_RATIO, _num(figures.get("exact_match")), data=data, model=model)
                v.set(m.LAST_RUN_TOKEN_ACCURACY_RATIO, _num(figures.get("token_accuracy")), data=data, model=model)
        # [hotswap.shadow]: the share of probes the server answered as the candidate did in process
        v.set(m.LAST_RUN_EXACT_MATCH_RATIO, _num((s.metrics.get("probe_server") or {}).get("exact_match")),
              data="probe", model="server")
        if s.regression_samples is not None:
            v.set(m.REGRESSION_SET_SAMPLES, s.regression_samples)
        v.set(m.LAST_RUN_KL_FROM_SERVICE_NATS, _num(s.kl_from_service))

    def _last_run(self, s: RunSummary, ended: float, window_end: float | None) -> None:
        """Every last-run gauge from one summary: at a run's end, and from the ledger at a restart."""
        v = self.values
        outcome = s.outcome.value
        for o in {*m.OUTCOMES, outcome}:
            v.set(m.LAST_RUN_OUTCOME, 1 if o == outcome else 0, outcome=o)
        v.set(m.LAST_RUN_TIMESTAMP_SECONDS, ended)
        if s.outcome == Outcome.succeeded:
            v.set(m.LAST_SUCCESS_TIMESTAMP_SECONDS, ended)
        v.clear(m.LAST_RUN_PHASE_DURATION_SECONDS)
        for phase, secs in s.phase_seconds.items():
            v.set(m.LAST_RUN_PHASE_DURATION_SECONDS, secs, phase=phase)
        v.set(m.LAST_RUN_OVERRUN_SECONDS, None if window_end is None else max(0.0, ended - window_end))
        v.set(m.LAST_RUN_STEPS, s.steps)
        v.set(m.LAST_RUN_RANKS, s.ranks if s.steps else None)  # known where the run trained
        v.set(m.LAST_RUN_TOKENS_PER_SECOND, s.tokens_per_second)
        v.set(m.LAST_RUN_SAMPLES_PER_HOUR, s.samples_per_hour)
        v.clear(m.LAST_RUN_LOSS)
        for field, (kind, stage) in m.LOSS_LABELS.items():
            v.set(m.LAST_RUN_LOSS, getattr(s.losses, field), kind=kind, stage=stage)
        if s.method is not None:  # a run that trained (or published): how
            v.clear(m.LAST_RUN_INFO)
            v.set(m.LAST_RUN_INFO, 1, method=s.method.value, backend=(s.plan.backend if s.plan else None) or "")
        self._answers(s)
        # the budget: seconds and tokens; a night cut short by its deadline shows in the tokens
        predicted, actual, planned = s.predicted_train_seconds, s.actual_train_seconds, s.planned_tokens
        completed = s.outcome in COMPLETED
        v.set(m.LAST_RUN_PREDICTED_TRAIN_SECONDS, predicted)
        v.set(m.LAST_RUN_ACTUAL_TRAIN_SECONDS, actual)
        v.set(m.LAST_RUN_BUDGET_RATIO, actual / predicted if completed and predicted and actual else None)
        v.set(m.LAST_RUN_PLANNED_TOKENS, planned)
        v.set(m.LAST_RUN_TRAINED_TOKENS, s.trained_tokens if planned is not None else None)
        v.set(m.LAST_RUN_TRAINED_TOKENS_RATIO, s.trained_tokens / planned if completed and planned else None)
        v.set(m.LAST_RUN_FIRST_STEP_SECONDS, s.first_step_seconds)
        v.set(m.LAST_RUN_DEFERRED_SAMPLES, s.deferred_samples)
        if s.backlog_samples is not None:
            self.set_backlog(s.backlog_samples, s.backlog_tokens)
        self._summary_gpu(s.gpu, s.trained_tokens)
        cost = summary_cost(s, self.price_per_gpu_hour)
        v.set(m.LAST_RUN_COST_PER_MILLION_TOKENS, cost.joules_per_million_tokens, unit="joules")
        v.set(m.LAST_RUN_COST_PER_MILLION_TOKENS, cost.dollars_per_million_tokens, unit="dollars")

    def restore_last_run(self, s: RunSummary, *, window_end: float | None = None) -> None:
        """The last run's gauges from its summary in the ledger at daemon start (no counter moves):
        dashboards and the budget alert keep their values across a restart or an upgrade."""
        with self._lock:
            self._last_run(s, s.ended_at or float(self.clock()), window_end)

    def _summary_gpu(self, gpu: GpuSummary | None, tokens: int) -> None:
        v = self.values
        for key, name in SUMMARY_GPU_GAUGES.items():
            v.set(name, _num(getattr(gpu, key)) if gpu else None)
        joules = gpu.energy_joules if gpu else None
        v.set(m.LAST_RUN_TOKENS_PER_JOULE, tokens / joules if joules and tokens else None)
        if gpu and gpu.total_memory_bytes is not None:
            v.set(m.GPU_MEMORY_TOTAL_BYTES, gpu.total_memory_bytes)
        if gpu and gpu.name:
            v.clear(m.GPU_INFO)
            v.set(m.GPU_INFO, 1, name=gpu.name)

    # ---- the daemon's own facts ---------------------------------------------------------
    def set_window(self, open: bool, next_start: float | None, end: float | None = None) -> None:
        """Window state; `end`: the open window's end (what "overran its window" is measured against)."""
        with self._lock:
            self.values.set(m.WINDOW_OPEN, 1 if open else 0)
            self.values.set(m.NEXT_WINDOW_START_TIMESTAMP_SECONDS, next_start)
            if open and end is not None:
                self._window_end = float(end)

    def set_adapter_in_service(self, version: int, name: str, base_model: str, method: str = "qlora") -> None:
        with self._lock:
            self.values.clear(m.ADAPTER_INFO)
            self.values.set(m.ADAPTER_INFO, 1, version=version, name=name, base_model=base_model, method=method)
            self.values.set(m.ADAPTER_VERSION, version)

    def _init_hotswap(self, kind: str) -> None:
        for outcome in m.HOTSWAP_OUTCOMES:
            self.values.setdefault(m.HOTSWAP_ATTEMPTS_TOTAL, 0, kind=kind, outcome=outcome)
        self.values.setdefault(m.HOTSWAP_CONSECUTIVE_FAILURES, 0, kind=kind)

    def on_hotswap(self, kind: str, ok: bool) -> None:
        """One target's hot-swap result (after its retries)."""
        success, failure = m.HOTSWAP_OUTCOMES
        with self._lock:
            self._init_hotswap(kind)
            self.values.inc(m.HOTSWAP_ATTEMPTS_TOTAL, kind=kind, outcome=success if ok else failure)
            failures = self.values.get(m.HOTSWAP_CONSECUTIVE_FAILURES, kind=kind) or 0.0
            self.values.set(m.HOTSWAP_CONSECUTIVE_FAILURES, 0 if ok else failures + 1, kind=kind)

    def set_backlog(self, samples: int | None, tokens: int | None) -> None:
        self.values.set(m.BACKLOG_SAMPLES, _num(samples))
        self.values.set(m.BACKLOG_TOKENS, _num(tokens))

    def restore(
        self, *, last_success: float | None = None, last_run: float | None = None, last_outcome: str | None = None
    ) -> None:
        """Seed the last-run facts from the ledger at daemon start (a restart must not hide a stale success)."""
        with self._lock:
            v = self.values
            v.set(m.LAST_SUCCESS_TIMESTAMP_SECONDS, last_success)
            v.set(m.LAST_RUN_TIMESTAMP_SECONDS, last_run)
            if last_outcome is not None:
                for o in {*m.OUTCOMES, last_outcome}:
                    v.set(m.LAST_RUN_OUTCOME, 1 if o == last_outcome else 0, outcome=o)
