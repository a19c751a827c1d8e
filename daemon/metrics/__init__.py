"""Prometheus metrics of the daemon: one catalogue of series (`catalog`), the translation of the
night's child events, RunSummary and the daemon's own facts into them (`night`), and the
/metrics endpoint (`exporter`)."""

from daemon.metrics.catalog import OUTCOMES, PHASES, QUARANTINE_REASONS, SPECS, Spec
from daemon.metrics.exporter import MetricsConfig, MetricsServer, serve
from daemon.metrics.night import NightshiftMetrics

__all__ = [
    "OUTCOMES",
    "PHASES",
    "QUARANTINE_REASONS",
    "SPECS",
    "MetricsConfig",
    "MetricsServer",
    "NightshiftMetrics",
    "Spec",
    "serve",
]
