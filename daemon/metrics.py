"""Prometheus metrics of the daemon: what the child reports, turned into conventional series.

Why this shape:
- One registry passed in (tests use a fresh `CollectorRegistry()`), no multiprocess mode:
  the child's figures reach the daemon as contract events over the supervisor's pipe,
  and `on_event` / `on_summary` turn them into series here.
- Unknown is absent, not zero: GPU series exist only once a GPU reported, last-run
  figures only once a run gave them (a 0 W card or a 0 s success would be a lie that
  alerts believe). That is why values live in `_Values`, a small collector that yields a
  family only when it holds samples; counters that are meaningful at 0 are pre-set.
- The energy counter adds only positive deltas of the card's running total: a new child,
  a counter reset or a long gap re-baselines instead of adding the card's whole history.
- Names: `nightshift_` prefix, base units, `_total` counters, labels bounded by code or
  config (outcome, phase, reason, source, target kind).
"""

from __future__ import annotations

import platform
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from threading import Thread
from typing import Any, Literal, NamedTuple
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from jobs.contract import (
    ChildEvent,
    GpuEvent,
    GpuSummary,
    HotswapEvent,
    Outcome,
    Phase,
    PhaseEvent,
    ProgressEvent,
    ResultEvent,
    RunSummary,
    nightshift_version,
)

log = structlog.get_logger("nightshift.metrics")

OUTCOMES = tuple(o.value for o in Outcome)
PHASES = tuple(p.value for p in Phase)
QUARANTINE_REASONS = (
    "invalid_json",
    "invalid_utf8",
    "bad_file",
    "missing_field",
    "empty_field",
    "wrong_type",
    "too_long",
)
# minutes to hours: a skipped night takes seconds, a full window up to ~8 h
RUN_DURATION_BUCKETS = (30, 60, 300, 600, 1200, 1800, 3600, 5400, 7200, 10800, 14400, 21600, 28800, 43200)
# summary "losses" key -> (kind, stage) labels
LOSS_LABELS = {
    "train": ("train", "after"),
    "heldout_before": ("heldout", "before"),
    "heldout_after": ("heldout", "after"),
    "regression_before": ("regression", "before"),
    "regression_after": ("regression", "after"),
}


class MetricsConfig(BaseModel):
    """[metrics]: the /metrics endpoint."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    address: str = Field("127.0.0.1", description="listen address (loopback: scrape through a local Prometheus)")
    port: int = Field(9464, ge=0, le=65535, description="listen port (0: any free port, for tests)")


@dataclass(frozen=True)
class Spec:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()


G: Literal["gauge"] = "gauge"
C: Literal["counter"] = "counter"
SPECS: tuple[Spec, ...] = (
    # runs
    Spec("nightshift_runs_total", C, "Finished night runs by outcome.", ("outcome",)),
    Spec(
        "nightshift_last_run_outcome", G, "1 for the outcome of the last finished run, 0 for the others.", ("outcome",)
    ),
    Spec("nightshift_last_success_timestamp_seconds", G, "End of the last run that succeeded (unix seconds)."),
    Spec("nightshift_last_run_timestamp_seconds", G, "End of the last finished run, any outcome (unix seconds)."),
    Spec("nightshift_last_run_phase_duration_seconds", G, "Seconds each phase took in the last run.", ("phase",)),
    Spec("nightshift_last_run_overrun_seconds", G, "Seconds the last run ended after its window's end (0: in time)."),
    Spec("nightshift_run_in_progress", G, "1 while a night's child runs."),
    Spec("nightshift_run_phase", G, "1 for the phase the running child is in.", ("phase",)),
    Spec("nightshift_run_progress_ratio", G, "Fraction of the planned training done by the running child."),
    Spec("nightshift_window_open", G, "1 while inside the configured training window."),
    Spec("nightshift_next_window_start_timestamp_seconds", G, "Start of the next training window (unix seconds)."),
    # training (last_run_*: the most recent run, updated live while it runs)
    Spec("nightshift_trained_tokens_total", C, "Tokens trained on (real tokens, padding excluded)."),
    Spec("nightshift_trained_samples_total", C, "Samples trained on."),
    Spec("nightshift_last_run_steps", G, "Optimizer steps of the last run."),
    Spec("nightshift_last_run_tokens_per_second", G, "Training throughput of the last run."),
    Spec("nightshift_last_run_samples_per_hour", G, "Samples per hour of training in the last run."),
    Spec(
        "nightshift_last_run_loss",
        G,
        "Losses of the last run: kind=train|heldout|regression; stage=before (adapter in service) or after "
        "(the candidate; for train, the run's mean training loss).",
        ("kind", "stage"),
    ),
    # budget
    Spec("nightshift_last_run_predicted_train_seconds", G, "Train seconds the plan predicted for the last run."),
    Spec("nightshift_last_run_actual_train_seconds", G, "Train seconds the last run actually took."),
    Spec("nightshift_last_run_budget_ratio", G, "Actual / predicted train seconds of the last completed training."),
    Spec("nightshift_last_run_deferred_samples", G, "Pending samples the last run's plan left for a later night."),
    Spec("nightshift_backlog_samples", G, "Samples ingested and not trained yet."),
    Spec("nightshift_backlog_tokens", G, "Tokens of the samples ingested and not trained yet."),
    # data
    Spec("nightshift_ingested_samples_total", C, "New samples ingested, by source.", ("source",)),
    Spec("nightshift_quarantined_samples_total", C, "Records quarantined, by reason.", ("reason",)),
    Spec("nightshift_ingested_files_total", C, "Inbox files ingested."),
    Spec("nightshift_duplicate_samples_total", C, "Records skipped as already seen."),
    # GPU (absent without one)
    Spec("nightshift_gpu_info", G, "The card the last run trained on.", ("name",)),
    Spec("nightshift_gpu_power_watts", G, "Card power draw now (NVML, while a child runs)."),
    Spec("nightshift_gpu_energy_joules_total", C, "Energy the card used while nights ran (NVML counter deltas)."),
    Spec("nightshift_gpu_memory_used_bytes", G, "Card memory in use now, all processes (NVML)."),
    Spec("nightshift_gpu_memory_total_bytes", G, "Card memory size (NVML)."),
    Spec("nightshift_gpu_utilization_ratio", G, "Card utilisation now, 0..1 (NVML)."),
    Spec("nightshift_gpu_temperature_celsius", G, "Card temperature now (NVML)."),
    Spec("nightshift_last_run_gpu_mean_power_watts", G, "Mean card power over the last run."),
    Spec("nightshift_last_run_gpu_energy_joules", G, "Card energy used by the last run."),
    Spec("nightshift_last_run_tokens_per_joule", G, "Tokens trained per joule in the last run."),
    Spec("nightshift_last_run_gpu_peak_allocated_bytes", G, "torch max memory allocated in the last run."),
    Spec("nightshift_last_run_gpu_peak_reserved_bytes", G, "torch max memory reserved in the last run."),
    # adapters
    Spec("nightshift_adapter_info", G, "The adapter version in service.", ("version", "name", "base_model")),
    Spec("nightshift_adapter_version", G, "Version number of the adapter in service."),
    Spec("nightshift_adapter_versions_published_total", C, "Adapter versions published (promoted or not)."),
    Spec(
        "nightshift_hotswap_attempts_total",
        C,
        "Hot-swap notifications by target kind and outcome (one per target per swap, after its retries).",
        ("kind", "outcome"),
    ),
    Spec(
        "nightshift_hotswap_consecutive_failures",
        G,
        "Failed hot-swaps since the last success, by target kind.",
        ("kind",),
    ),
    Spec("nightshift_build_info", G, "Build of the running daemon.", ("version", "python_version")),
)
LIVE_GPU = (
    "nightshift_gpu_power_watts",
    "nightshift_gpu_memory_used_bytes",
    "nightshift_gpu_utilization_ratio",
    "nightshift_gpu_temperature_celsius",
)
GPU_EVENT_GAUGES = {
    "power_watts": "nightshift_gpu_power_watts",
    "vram_used_bytes": "nightshift_gpu_memory_used_bytes",
    "vram_total_bytes": "nightshift_gpu_memory_total_bytes",
    "utilization_ratio": "nightshift_gpu_utilization_ratio",
    "temperature_celsius": "nightshift_gpu_temperature_celsius",
}
SUMMARY_GPU_GAUGES = {
    "mean_power_watts": "nightshift_last_run_gpu_mean_power_watts",
    "energy_joules": "nightshift_last_run_gpu_energy_joules",
    "peak_allocated_bytes": "nightshift_last_run_gpu_peak_allocated_bytes",
    "peak_reserved_bytes": "nightshift_last_run_gpu_peak_reserved_bytes",
}


class _Values(Collector):
    """Samples by metric name and label values; a family is exposed only while it holds samples."""

    def __init__(self, specs: Iterable[Spec]) -> None:
        self.specs = {s.name: s for s in specs}
        self._data: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in self.specs}
        self._lock = threading.Lock()

    def _key(self, metric: str, labels: Mapping[str, Any]) -> tuple[str, ...]:
        spec = self.specs[metric]
        if set(labels) != set(spec.labels):
            raise ValueError(f"{metric} takes labels {spec.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in spec.labels)

    def set(self, metric: str, value: float | None, /, **labels: Any) -> None:
        """Set a sample; None removes it (unknown is absent)."""
        key = self._key(metric, labels)
        with self._lock:
            if value is None:
                self._data[metric].pop(key, None)
            else:
                self._data[metric][key] = float(value)

    def inc(self, metric: str, amount: float = 1.0, /, **labels: Any) -> None:
        if amount < 0:
            raise ValueError(f"{metric}: counters only go up (got {amount})")
        key = self._key(metric, labels)
        with self._lock:
            self._data[metric][key] = self._data[metric].get(key, 0.0) + amount

    def setdefault(self, metric: str, value: float, /, **labels: Any) -> None:
        key = self._key(metric, labels)
        with self._lock:
            self._data[metric].setdefault(key, float(value))

    def clear(self, metric: str) -> None:
        with self._lock:
            self._data[metric].clear()

    def get(self, metric: str, /, **labels: Any) -> float | None:
        key = self._key(metric, labels)
        with self._lock:
            return self._data[metric].get(key)

    def _family(self, spec: Spec) -> Metric:
        cls = CounterMetricFamily if spec.kind == C else GaugeMetricFamily
        return cls(spec.name, spec.help, labels=spec.labels)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {n: dict(v) for n, v in self._data.items() if v}
        for name, values in snapshot.items():
            fam = self._family(self.specs[name])
            for key, value in sorted(values.items()):
                fam.add_metric(list(key), value)  # type: ignore[attr-defined]
            yield fam

    def describe(self) -> Iterator[Metric]:
        for spec in self.specs.values():
            yield self._family(spec)


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
        clock: Any = time.time,
        sources: Iterable[str] = (),
        hotswap_kinds: Iterable[str] = (),
        energy_gap_seconds: float = 120.0,
        version: str | None = None,
    ) -> None:
        self.clock = clock
        self.energy_gap_seconds = energy_gap_seconds
        self.values = _Values(SPECS)
        registry.register(self.values)
        self.run_duration = Histogram(
            "nightshift_run_duration_seconds",
            "Wall time of finished night runs.",
            buckets=RUN_DURATION_BUCKETS,
            registry=registry,
        )
        self._lock = threading.RLock()
        self._high_water: dict[int, tuple[int, int]] = {}  # version -> (tokens, samples) already counted
        self._published: set[int] = set()
        self._seen: deque[tuple[Any, ...]] = deque(maxlen=32)  # summaries already counted
        self._energy_last: float | None = None
        self._energy_ts = 0.0
        self._window_end: float | None = None
        self._run_window_end: float | None = None
        v = self.values
        for outcome in OUTCOMES:
            v.set("nightshift_runs_total", 0, outcome=outcome)
        for reason in QUARANTINE_REASONS:
            v.set("nightshift_quarantined_samples_total", 0, reason=reason)
        for source in sources:
            v.set("nightshift_ingested_samples_total", 0, source=source)
        for kind in hotswap_kinds:
            self._init_hotswap(kind)
        for name in (
            "nightshift_trained_tokens_total",
            "nightshift_trained_samples_total",
            "nightshift_ingested_files_total",
            "nightshift_duplicate_samples_total",
            "nightshift_adapter_versions_published_total",
            "nightshift_run_in_progress",
        ):
            v.set(name, 0)
        v.set(
            "nightshift_build_info", 1, version=version or nightshift_version(),
            python_version=platform.python_version()
        )

    # ---- the child's events -------------------------------------------------------------
    def on_event(self, event: ChildEvent) -> None:
        """One typed event from the child (validated where the pipe is read)."""
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
        if not self.values.get("nightshift_run_in_progress"):
            self.values.set("nightshift_run_in_progress", 1)
            self._run_window_end = self._window_end

    def _on_phase(self, ev: PhaseEvent) -> None:
        if ev.state == "start":
            self.values.clear("nightshift_run_phase")
            self.values.set("nightshift_run_phase", 1, phase=ev.phase.value)
        else:
            self.values.set("nightshift_run_phase", None, phase=ev.phase.value)

    def _on_progress(self, ev: ProgressEvent) -> None:
        v = self.values
        v.set("nightshift_run_progress_ratio", ev.fraction)
        v.set("nightshift_last_run_steps", ev.steps)
        v.set("nightshift_last_run_tokens_per_second", ev.tokens_per_second)
        self._count_trained(ev.version, ev.tokens, ev.samples)

    def _count_trained(self, version: int | None, tokens: int, samples: int) -> None:
        """Counters follow the run's cumulative figures: a resumed run restarts from its checkpoint's."""
        seen_tokens, seen_samples = self._high_water.get(version, (0, 0)) if version is not None else (0, 0)
        self.values.inc("nightshift_trained_tokens_total", max(0, tokens - seen_tokens))
        self.values.inc("nightshift_trained_samples_total", max(0, samples - seen_samples))
        if version is not None:
            self._high_water[version] = (max(tokens, seen_tokens), max(samples, seen_samples))

    def _on_gpu(self, ev: GpuEvent) -> None:
        for key, name in GPU_EVENT_GAUGES.items():
            if key == "vram_total_bytes" and ev.vram_total_bytes is None:
                continue  # the card's size stays known between runs
            self.values.set(name, _num(getattr(ev, key)))
        energy = _num(ev.energy_joules_total)
        if energy is None:
            return
        ts = float(ev.ts or self.clock())
        last = self._energy_last
        if last is not None and energy >= last and ts - self._energy_ts <= self.energy_gap_seconds:
            self.values.inc("nightshift_gpu_energy_joules_total", energy - last)
        else:  # first reading of a child, a counter reset or a gap: re-baseline, add nothing
            self.values.setdefault("nightshift_gpu_energy_joules_total", 0.0)
        self._energy_last, self._energy_ts = energy, ts

    def on_child_exit(self) -> None:
        """The child is gone (finished, crashed or killed): live series become absent."""
        with self._lock:
            self._end_run()

    def _end_run(self) -> None:
        v = self.values
        v.set("nightshift_run_in_progress", 0)
        v.clear("nightshift_run_phase")
        v.set("nightshift_run_progress_ratio", None)
        for name in LIVE_GPU:
            v.set(name, None)
        self._energy_last = None

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
        outcome = s.outcome.value
        ended = s.ended_at or float(self.clock())
        v.inc("nightshift_runs_total", outcome=outcome)
        for o in OUTCOMES:
            v.set("nightshift_last_run_outcome", 1 if o == outcome else 0, outcome=o)
        v.set("nightshift_last_run_timestamp_seconds", ended)
        if outcome == "succeeded":
            v.set("nightshift_last_success_timestamp_seconds", ended)
        if s.started_at is not None and ended >= s.started_at:
            self.run_duration.observe(ended - s.started_at)
        v.clear("nightshift_last_run_phase_duration_seconds")
        for phase, secs in s.phase_seconds.items():
            v.set("nightshift_last_run_phase_duration_seconds", secs, phase=phase)
        end_limit = self._run_window_end or self._window_end or s.deadline
        v.set("nightshift_last_run_overrun_seconds", None if end_limit is None else max(0.0, ended - end_limit))
        self._run_window_end = None
        # training and budget
        self._count_trained(s.version, s.trained_tokens, s.trained_samples)
        v.set("nightshift_last_run_steps", s.steps)
        v.set("nightshift_last_run_tokens_per_second", s.tokens_per_second)
        v.set("nightshift_last_run_samples_per_hour", s.samples_per_hour)
        v.clear("nightshift_last_run_loss")
        for k, value in s.losses.model_dump().items():
            if k in LOSS_LABELS and value is not None:
                kind, stage = LOSS_LABELS[k]
                v.set("nightshift_last_run_loss", value, kind=kind, stage=stage)
        predicted, actual = s.predicted_train_seconds, s.actual_train_seconds
        v.set("nightshift_last_run_predicted_train_seconds", predicted)
        v.set("nightshift_last_run_actual_train_seconds", actual)
        completed = outcome in ("succeeded", "rejected")  # an interrupted run's time says nothing of the plan
        v.set("nightshift_last_run_budget_ratio", actual / predicted if completed and predicted and actual else None)
        v.set("nightshift_last_run_deferred_samples", s.deferred_samples)
        if s.backlog_samples is not None:
            self.set_backlog(s.backlog_samples, s.backlog_tokens)
        # data
        for source, n in s.ingested.items():
            v.inc("nightshift_ingested_samples_total", n, source=source)
        for reason, n in s.quarantined.items():
            v.inc("nightshift_quarantined_samples_total", n, reason=reason)
        v.inc("nightshift_ingested_files_total", s.files_ingested)
        v.inc("nightshift_duplicate_samples_total", s.duplicates)
        self._summary_gpu(s.gpu, s.trained_tokens)
        # adapters
        version = s.version
        if version is not None and s.adapter_path and completed and version not in self._published:
            self._published.add(version)
            v.inc("nightshift_adapter_versions_published_total")
        if s.promoted and version is not None:
            self.set_adapter_in_service(version, s.version_name or str(version), s.base_model)

    def _summary_gpu(self, gpu: GpuSummary | None, tokens: int) -> None:
        v = self.values
        for key, name in SUMMARY_GPU_GAUGES.items():
            v.set(name, _num(getattr(gpu, key)) if gpu else None)
        joules = gpu.energy_joules if gpu else None
        v.set("nightshift_last_run_tokens_per_joule", tokens / joules if joules and tokens else None)
        if gpu and gpu.total_memory_bytes is not None:
            v.set("nightshift_gpu_memory_total_bytes", gpu.total_memory_bytes)
        if gpu and gpu.name:
            v.clear("nightshift_gpu_info")
            v.set("nightshift_gpu_info", 1, name=gpu.name)

    # ---- the daemon's own facts ---------------------------------------------------------
    def set_window(self, open: bool, next_start: float | None, end: float | None = None) -> None:
        """Window state; `end`: the open window's end (what "overran its window" is measured against)."""
        with self._lock:
            self.values.set("nightshift_window_open", 1 if open else 0)
            self.values.set("nightshift_next_window_start_timestamp_seconds", next_start)
            if open and end is not None:
                self._window_end = float(end)

    def set_adapter_in_service(self, version: int, name: str, base_model: str) -> None:
        with self._lock:
            self.values.clear("nightshift_adapter_info")
            self.values.set("nightshift_adapter_info", 1, version=version, name=name, base_model=base_model)
            self.values.set("nightshift_adapter_version", version)

    def _init_hotswap(self, kind: str) -> None:
        for outcome in ("success", "failure"):
            self.values.setdefault("nightshift_hotswap_attempts_total", 0, kind=kind, outcome=outcome)
        self.values.setdefault("nightshift_hotswap_consecutive_failures", 0, kind=kind)

    def on_hotswap(self, kind: str, ok: bool) -> None:
        """One target's hot-swap result (after its retries)."""
        with self._lock:
            self._init_hotswap(kind)
            self.values.inc("nightshift_hotswap_attempts_total", kind=kind, outcome="success" if ok else "failure")
            failures = self.values.get("nightshift_hotswap_consecutive_failures", kind=kind) or 0.0
            self.values.set("nightshift_hotswap_consecutive_failures", 0 if ok else failures + 1, kind=kind)

    def set_backlog(self, samples: int | None, tokens: int | None) -> None:
        self.values.set("nightshift_backlog_samples", _num(samples))
        self.values.set("nightshift_backlog_tokens", _num(tokens))

    def restore(
        self, *, last_success: float | None = None, last_run: float | None = None, last_outcome: str | None = None
    ) -> None:
        """Seed the last-run facts from the ledger at daemon start (a restart must not hide a stale success)."""
        with self._lock:
            v = self.values
            v.set("nightshift_last_success_timestamp_seconds", last_success)
            v.set("nightshift_last_run_timestamp_seconds", last_run)
            if last_outcome is not None:
                for o in {*OUTCOMES, last_outcome}:
                    v.set("nightshift_last_run_outcome", 1 if o == last_outcome else 0, outcome=o)


class MetricsServer(NamedTuple):
    """prometheus_client's HTTP server and its thread; `close()` shuts it down."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(cfg: MetricsConfig, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve /metrics from `registry` on cfg.address:cfg.port (None when disabled)."""
    if not cfg.enabled:
        return None
    server, thread = start_http_server(cfg.port, addr=cfg.address, registry=registry)
    srv = MetricsServer(server, thread)
    log.info("metrics_serving", url=f"http://{cfg.address}:{srv.port}/metrics")
    return srv
