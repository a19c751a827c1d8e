"""A real Prometheus server on loopback for integration tests (the Debian `prometheus` package).

Why a process of our own: the package may also start a system service on :9090; tests
never touch it. Each server gets a free loopback port, a temporary TSDB, a 1 s scrape
and evaluation interval, and is killed at the end.

    with prometheus_server(["127.0.0.1:9464"], tmp_path) as prom:
        prom.wait_for('nightshift_runs_total{outcome="succeeded"}')
        prom.value('nightshift_runs_total{outcome="succeeded"}')  # -> 1.0
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "the prometheus server is not installed (Debian: apt-get install prometheus)"
NO_PROMTOOL = "promtool is not installed (Debian: apt-get install prometheus)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PromServer:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data` (raises on an error status)."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query: [{"metric": {labels}, "value": [ts, "value"]}, ...]."""
        data = self.api("query", query=expr, time=at)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query (None: no series; error: more than one)."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr} gave {len(result)} series: {result}")
        return float(result[0]["value"][1])

    def wait_for(
        self, expr: str, ok: Callable[[list[dict[str, Any]]], bool] = bool, timeout: float = 30.0
    ) -> list[dict[str, Any]]:
        """Poll `expr` until `ok(result)` (default: any series); TimeoutError with the last result."""
        end = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < end:
            result = self.query(expr)
            if ok(result):
                return result
            self._check_alive()
            time.sleep(0.25)
        raise TimeoutError(
            f"{expr} not satisfied after {timeout} s; last result {result}; "
            f"targets {self.api('targets')['activeTargets']}"
        )

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        log = self.workdir / "prometheus.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write_config(
    workdir: Path,
    targets: Sequence[str],
    *,
    job: str = "nightshift",
    interval: str = "1s",
    rule_files: Sequence[Path] = (),
) -> Path:
    cfg = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
    }
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@contextmanager
def prometheus_server(
    targets: Sequence[str],
    workdir: Path,
    *,
    job: str = "nightshift",
    interval: str = "1s",
    rule_files: Sequence[Path] = (),
    start_timeout: float = 30.0,
) -> Iterator[PromServer]:
    """Start `prometheus` scraping `targets` (host:port) every `interval`; yields once it is ready."""
    if PROMETHEUS is None:
        raise RuntimeError(NO_PROMETHEUS)
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir, targets, job=job, interval=interval, rule_files=rule_files)
    for attempt in range(3):  # the free port may be taken between free_port() and prometheus' bind
        port = free_port()
        with open(workdir / "prometheus.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / f'data{attempt}'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        server = PromServer(proc, port, workdir)
        try:
            if _wait_ready(server, start_timeout):
                break
        except BaseException:
            server.close()
            raise
        server.close()
        if "address already in use" not in server.log_tail():
            raise RuntimeError(f"prometheus did not start: {server.log_tail()}")
    else:
        raise RuntimeError("prometheus: no free port after 3 attempts")
    try:
        yield server
    finally:
        server.close()


def _wait_ready(server: PromServer, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"prometheus not ready after {timeout} s: {server.log_tail()}")
