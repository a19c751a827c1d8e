"""The exposition side: a collector of catalogued values, and the /metrics HTTP endpoint.

Why a collector of our own (`_Values`) rather than prometheus_client's Gauge/Counter objects:
unknown is absent, not zero. A family is yielded only while it holds samples, so a GPU series
exists only once a GPU reported and a last-run figure only once a run gave it (a 0 W card or a
0 s success would be a lie that alerts believe). Samples are keyed by catalogued name and
checked against the catalogue's labels, so a typo is an error at the call, not a new series.
An empty `adapter` (a config of one adapter) is left out of the exposed sample, as Prometheus would
drop it anyway: a single-adapter daemon's exposition is what it was before the label existed.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from threading import Thread
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, field_validator

from daemon.metrics.catalog import ADAPTER, COUNTER, GAUGE, Spec

log = structlog.get_logger("nightshift.metrics")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


class MetricsConfig(BaseModel):
    """[metrics]: the /metrics endpoint."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    address: str = Field("127.0.0.1", description="listen address (loopback: scrape through a local Prometheus)")
    port: int = Field(9464, ge=0, le=65535, description="listen port (0: any free port, for tests)")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        v = v.strip()
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        if re.fullmatch(r"[0-9.]+", v):
            raise ValueError(f"{v!r} is not an IPv4 address")
        if not _HOSTNAME.fullmatch(v):
            raise ValueError(f"{v!r} is neither an IP address nor a host name")
        return v


class _Values(Collector):
    """Samples by metric name and label values; a family is exposed only while it holds samples."""

    def __init__(self, specs: Iterable[Spec]) -> None:
        self.specs = {s.name: s for s in specs}
        for spec in self.specs.values():
            if spec.kind not in (GAUGE, COUNTER):
                raise ValueError(f"{spec.name}: a {spec.kind} is not a plain value")
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

    def clear(self, metric: str, /, **match: Any) -> None:
        """Remove every sample of `metric`, or only those whose labels include `match` (one adapter's)."""
        spec = self.specs[metric]
        if not set(match) <= set(spec.labels):
            raise ValueError(f"{metric} takes labels {spec.labels}, got {tuple(match)}")
        where = [(spec.labels.index(k), str(v)) for k, v in match.items()]
        with self._lock:
            data = self._data[metric]
            for key in [k for k in data if all(k[i] == v for i, v in where)]:
                del data[key]

    def scoped(self, adapter: str) -> _Scoped:
        """The same values seen from one adapter: its name goes into every series that takes `adapter`."""
        return _Scoped(self, adapter)

    def get(self, metric: str, /, **labels: Any) -> float | None:
        key = self._key(metric, labels)
        with self._lock:
            return self._data[metric].get(key)

    def _family(self, spec: Spec) -> Metric:
        cls = CounterMetricFamily if spec.kind == COUNTER else GaugeMetricFamily
        return cls(spec.name, spec.help, labels=spec.labels)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {n: dict(v) for n, v in self._data.items() if v}
        for name, values in snapshot.items():
            spec = self.specs[name]
            fam = self._family(spec)
            sample = fam.name + ("_total" if spec.kind == COUNTER else "")
            for key, value in sorted(values.items()):
                labels = {k: v for k, v in zip(spec.labels, key, strict=True) if v or k != ADAPTER}
                fam.add_sample(sample, labels, value)
            yield fam

    def describe(self) -> Iterator[Metric]:
        for spec in self.specs.values():
            yield self._family(spec)


class _Scoped:
    """One adapter's view of the values: `adapter=<name>` is added where the series takes it (the
    night's own series, `catalog.NIGHT_WIDE`, take none), and `clear` clears only this adapter's."""

    def __init__(self, values: _Values, adapter: str) -> None:
        self.values, self.adapter = values, adapter

    def _with(self, metric: str, labels: dict[str, Any]) -> dict[str, Any]:
        return {ADAPTER: self.adapter, **labels} if ADAPTER in self.values.specs[metric].labels else labels

    def set(self, metric: str, value: float | None, /, **labels: Any) -> None:
        self.values.set(metric, value, **self._with(metric, labels))

    def inc(self, metric: str, amount: float = 1.0, /, **labels: Any) -> None:
        self.values.inc(metric, amount, **self._with(metric, labels))

    def setdefault(self, metric: str, value: float, /, **labels: Any) -> None:
        self.values.setdefault(metric, value, **self._with(metric, labels))

    def get(self, metric: str, /, **labels: Any) -> float | None:
        return self.values.get(metric, **self._with(metric, labels))

    def clear(self, metric: str) -> None:
        self.values.clear(metric, **self._with(metric, {}))


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
