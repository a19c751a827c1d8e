"""The night as series: the child's events, its RunSummary and the daemon's own facts, turned into
the catalogued values.

Why this shape:
- One registry passed in (tests use a fresh `CollectorRegistry()`), no multiprocess mode: the
  child's figures reach the daemon as typed contract events over the supervisor's pipe, and
  `on_event` / `on_summary` turn them into series here.
- Unknown is absent, not zero (see exporter.py); counters that are meaningful at 0 are pre-set.
- The energy counter adds only positive deltas of the card's running total: a new child, a
  counter reset or a long gap re-baselines instead of adding the card's whole history.
- Several adapters in one night (issue 43): each summary and event names its adapter and lands in
  that adapter's series only (`_Values.scoped`); counters and "already counted" memories are kept
  per adapter, since every adapter numbers its own versions from 1. Only the configured adapter names
  (and "", a config of one adapter) become label values: the label's cardinality is the config's, so
  a stray name (a bug, an old ledger) cannot grow the series without bound; it is logged and dropped.
"""

from __future__ import annotations

import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Histogram

from daemon.metrics import catalog as m  # every series is named as m.<CONSTANT>
from daemon.metrics.exporter import _Scoped, _Values
from daemon.metrics.last_run import COMPLETED, as_float, last_run
from jobs.contract import (
    ChildEvent,
    GpuEvent,
    HotswapEvent,
    Method,
    PhaseEvent,
    ProgressEvent,
    ResultEvent,
    RunSummary,
    nightshift_version,
)

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
log = structlog.get_logger("nightshift.metrics")


class NightshiftMetrics:
    """Every nightshift series, fed by the child's events, its RunSummary and the daemon's own facts.

    Thread-safe: events arrive on the supervisor's reader thread, scrapes on the HTTP server's.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.time,
        sources: Iterable[str] | Mapping[str, Iterable[str]] = (),
        hotswap_kinds: Iterable[str] = (),
        energy_gap_seconds: float = 120.0,
        version: str | None = None,
        adapters: Iterable[str] = (),
        price_per_gpu_hour: float | None = None,
    ) -> None:
        """`adapters`: the configured adapter names of a config of several ([[adapters]]); none (or
        [""]) in a config of one. `sources`: source names, or adapter -> its sources where several."""
        self.clock = clock
        self.price_per_gpu_hour = price_per_gpu_hour  # [gpu]: the last run's dollars per million tokens
        self.energy_gap_seconds = energy_gap_seconds
        self.values = _Values(s for s in m.SPECS if s.kind != m.HISTOGRAM)
        registry.register(self.values)
        self.adapters = tuple(sorted({a for a in adapters if a}))
        self._allowed = {"", *self.adapters}
        self._unknown: set[str] = set()  # stray adapter names already logged
        duration = m.BY_NAME[m.RUN_DURATION_SECONDS]
        self.run_duration = Histogram(duration.name, duration.help, buckets=duration.buckets, registry=registry,
                                      labelnames=(m.ADAPTER,) if self.adapters else ())
        self._lock = threading.RLock()
        self._high_water: dict[tuple[str, int], tuple[int, int]] = {}  # (adapter, version) -> (tokens, samples)
        self._published: set[tuple[str, int]] = set()
        self._seen: deque[tuple[Any, ...]] = deque(maxlen=64)  # summaries already counted
        self._energy_last: float | None = None
        self._energy_ts = 0.0
        self._window_end: float | None = None
        self._run_window_end: float | None = None
        kinds = tuple(hotswap_kinds)
        for a in self.adapters or ("",):
            v = self.values.scoped(a)
            if self.adapters:
                self.run_duration.labels(a)  # the adapter's histogram exists (at 0) from the start
            for outcome in m.OUTCOMES:
                v.set(m.RUNS_TOTAL, 0, outcome=outcome)
            for reason in m.QUARANTINE_REASONS:
                v.set(m.QUARANTINED_SAMPLES_TOTAL, 0, reason=reason)
            for source in sources.get(a, ()) if isinstance(sources, Mapping) else sources:
                v.set(m.INGESTED_SAMPLES_TOTAL, 0, source=source)
            for kind in kinds:
                self._init_hotswap(v, kind)
            for name in ZERO_AT_START:
                v.set(name, 0)
        self.values.set(m.BUILD_INFO, 1, version=version or nightshift_version(),
                        python_version=platform.python_version())

    def _scope(self, adapter: str) -> _Scoped | None:
        """The adapter's series, or None for a name not configured (logged once, kept out of the labels)."""
        if adapter in self._allowed:
            return self.values.scoped(adapter)
        if adapter not in self._unknown:
            self._unknown.add(adapter)
            log.warning("metrics_unknown_adapter", adapter=adapter, configured=list(self.adapters))
        return None

    # ---- the child's events -------------------------------------------------------------
    def on_event(self, event: ChildEvent) -> None:
        """One typed event from the child (validated where the pipe is read); plan and OOM-split
        events carry nothing for the series."""
        if isinstance(event, ResultEvent):
            self.on_summary(event.summary)
            return
        if isinstance(event, HotswapEvent):
            self.on_hotswap(event.outcome.kind, event.outcome.ok, adapter=event.adapter)
            return
        if not isinstance(event, PhaseEvent | ProgressEvent | GpuEvent):
            return
        with self._lock:
            self._begin_run()
            if isinstance(event, GpuEvent):  # the card's: whichever adapter trains
                self._on_gpu(event)
            elif (v := self._scope(event.adapter)) is None:
                return
            elif isinstance(event, PhaseEvent):
                self._on_phase(event, v)
            else:
                self._on_progress(event, v)

    def _begin_run(self) -> None:
        if not self.values.get(m.RUN_IN_PROGRESS):
            self.values.set(m.RUN_IN_PROGRESS, 1)
            self._run_window_end = self._window_end

    def _on_phase(self, ev: PhaseEvent, v: _Scoped) -> None:
        if ev.state == "start":  # the child is in one phase of one adapter at a time
            self.values.clear(m.RUN_PHASE)
            v.set(m.RUN_PHASE, 1, phase=ev.phase.value)
        else:
            v.set(m.RUN_PHASE, None, phase=ev.phase.value)

    def _on_progress(self, ev: ProgressEvent, v: _Scoped) -> None:
        v.set(m.RUN_PROGRESS_RATIO, ev.fraction)
        v.set(m.LAST_RUN_STEPS, ev.steps)
        v.set(m.LAST_RUN_TOKENS_PER_SECOND, ev.tokens_per_second)
        self._count_trained(v, ev.version, ev.tokens, ev.samples)

    def _count_trained(self, v: _Scoped, version: int | None, tokens: int, samples: int) -> None:
        """Counters follow the run's cumulative figures: a resumed run restarts from its checkpoint's."""
        key = (v.adapter, version) if version is not None else None
        seen_tokens, seen_samples = self._high_water.get(key, (0, 0)) if key is not None else (0, 0)
        v.inc(m.TRAINED_TOKENS_TOTAL, max(0, tokens - seen_tokens))
        v.inc(m.TRAINED_SAMPLES_TOTAL, max(0, samples - seen_samples))
        if key is not None:
            self._high_water[key] = (max(tokens, seen_tokens), max(samples, seen_samples))

    def _on_gpu(self, ev: GpuEvent) -> None:
        for key, name in GPU_EVENT_GAUGES.items():
            if key == "vram_total_bytes" and ev.vram_total_bytes is None:
                continue  # the card's size stays known between runs
            self.values.set(name, as_float(getattr(ev, key)))
        for card in ev.cards:  # a night on several cards: each one's own reading
            for key, name in GPU_CARD_GAUGES.items():
                self.values.set(name, as_float(getattr(card, key)), gpu=card.gpu)
        energy = as_float(ev.energy_joules_total)
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
        v.clear(m.RUN_PROGRESS_RATIO)
        for name in LIVE_GPU:
            v.set(name, None)
        for name in GPU_CARD_GAUGES.values():
            v.clear(name)
        self._energy_last = None
        self._run_window_end = None
        v.set(m.RUN_IN_PROGRESS, 0)  # last: a scrape that reads 0 finds the live series gone too

    # ---- the RunSummary -----------------------------------------------------------------
    def on_summary(self, s: RunSummary) -> None:
        """A finished run. Unknown figures stay absent, so a crash can be reported as
        `RunSummary(outcome="failed", ended_at=ts)`; the same summary twice counts once.

        A named adapter's summary (a night of several) ends that adapter's live series only: the child
        goes on with the next adapter; its exit (or a summary of the whole night, adapter "") ends the run."""
        key = (s.adapter, s.run_id, s.started_at, s.ended_at, s.outcome)
        with self._lock:
            v = self._scope(s.adapter)
            if key in self._seen or v is None:
                return
            self._seen.append(key)
            if not s.adapter and s.adapters:  # the whole night of several: each adapter's result was counted
                self._end_run()
                return
            self._summary(s, v)
            if s.adapter:
                v.clear(m.RUN_PHASE)
                v.clear(m.RUN_PROGRESS_RATIO)
            else:
                self._end_run()

    def _summary(self, s: RunSummary, v: _Scoped) -> None:
        ended = s.ended_at or float(self.clock())
        v.inc(m.RUNS_TOTAL, outcome=s.outcome.value)
        if s.started_at is not None and ended >= s.started_at:
            (self.run_duration.labels(v.adapter) if self.adapters else self.run_duration).observe(ended - s.started_at)
        end_limit = self._run_window_end or self._window_end or s.deadline
        last_run(v, s, ended, end_limit, self.price_per_gpu_hour)
        # counters: training and data
        self._count_trained(v, s.version, s.trained_tokens, s.trained_samples)
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
        if version is not None and s.adapter_path and s.outcome in COMPLETED and (s.adapter, version) not in \
                self._published:
            self._published.add((s.adapter, version))
            v.inc(m.ADAPTER_VERSIONS_PUBLISHED_TOTAL)
        if s.promoted and version is not None:
            self.set_adapter_in_service(version, s.version_name or str(version), s.base_model,
                                        (s.method or Method.qlora).value, adapter=s.adapter)

    def restore_last_run(self, s: RunSummary, *, window_end: float | None = None, adapter: str | None = None) -> None:
        """The last run's gauges from its summary in the ledger at daemon start (no counter moves):
        dashboards and the budget alert keep their values across a restart or an upgrade.
        `adapter`: whose ledger it came from (default: the summary's own `adapter`)."""
        with self._lock:
            v = self._scope(s.adapter if adapter is None else adapter)
            if v is not None:
                last_run(v, s, s.ended_at or float(self.clock()), window_end, self.price_per_gpu_hour)

    # ---- the daemon's own facts ---------------------------------------------------------
    def set_window(self, open: bool, next_start: float | None, end: float | None = None) -> None:
        """Window state; `end`: the open window's end (what "overran its window" is measured against)."""
        with self._lock:
            self.values.set(m.WINDOW_OPEN, 1 if open else 0)
            self.values.set(m.NEXT_WINDOW_START_TIMESTAMP_SECONDS, next_start)
            if open and end is not None:
                self._window_end = float(end)

    def set_adapter_in_service(self, version: int, name: str, base_model: str, method: str = "qlora", *,
                               adapter: str = "") -> None:
        """The version in service of `adapter` (one info series per adapter)."""
        with self._lock:
            if (v := self._scope(adapter)) is None:
                return
            v.clear(m.ADAPTER_INFO)
            v.set(m.ADAPTER_INFO, 1, version=version, name=name, base_model=base_model, method=method)
            v.set(m.ADAPTER_VERSION, version)

    @staticmethod
    def _init_hotswap(v: _Scoped, kind: str) -> None:
        for outcome in m.HOTSWAP_OUTCOMES:
            v.setdefault(m.HOTSWAP_ATTEMPTS_TOTAL, 0, kind=kind, outcome=outcome)
        v.setdefault(m.HOTSWAP_CONSECUTIVE_FAILURES, 0, kind=kind)

    def on_hotswap(self, kind: str, ok: bool, *, adapter: str = "") -> None:
        """One target's hot-swap result of `adapter`'s version (after its retries)."""
        success, failure = m.HOTSWAP_OUTCOMES
        with self._lock:
            if (v := self._scope(adapter)) is None:
                return
            self._init_hotswap(v, kind)
            v.inc(m.HOTSWAP_ATTEMPTS_TOTAL, kind=kind, outcome=success if ok else failure)
            failures = v.get(m.HOTSWAP_CONSECUTIVE_FAILURES, kind=kind) or 0.0
            v.set(m.HOTSWAP_CONSECUTIVE_FAILURES, 0 if ok else failures + 1, kind=kind)

    def set_backlog(self, samples: int | None, tokens: int | None, *, adapter: str = "") -> None:
        with self._lock:
            if (v := self._scope(adapter)) is not None:
                v.set(m.BACKLOG_SAMPLES, as_float(samples))
                v.set(m.BACKLOG_TOKENS, as_float(tokens))

    def restore(
        self, *, last_success: float | None = None, last_run: float | None = None, last_outcome: str | None = None,
        adapter: str = "",
    ) -> None:
        """Seed `adapter`'s last-run facts from its ledger at daemon start (a restart must not hide a stale
        success)."""
        with self._lock:
            if (v := self._scope(adapter)) is None:
                return
            v.set(m.LAST_SUCCESS_TIMESTAMP_SECONDS, last_success)
            v.set(m.LAST_RUN_TIMESTAMP_SECONDS, last_run)
            if last_outcome is not None:
                for o in {*m.OUTCOMES, last_outcome}:
                    v.set(m.LAST_RUN_OUTCOME, 1 if o == last_outcome else 0, outcome=o)
