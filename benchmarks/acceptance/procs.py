"""The acceptance run's processes: the real daemon (`nightshift run`), the inference server, a client
that asks the server all along, a card sampler, and read-only looks into the ledger."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT = {"words": "w1 w2 w3 w4 w5 w6 w7 w8", "text": "Compute 12 plus 30."}


def http(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class Proc:
    """A child process whose stderr lines are kept (and written to a log file)."""

    def __init__(self, argv: list[str], *, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "a", encoding="utf-8")  # noqa: SIM115  (closed in wait/kill)
        self.lines: list[str] = []
        self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})}, cwd=cwd)
        self.pid = self.p.pid
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def events(self, name: str) -> list[dict[str, Any]]:
        """The JSON log lines whose event is `name`."""
        out = []
        for line in list(self.lines):
            if f'"{name}"' in line:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.alive():
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait(timeout=10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our child's child, not reaped yet) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.2) -> Any:
    end = time.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.time() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


class Ledger:
    """Read-only views of the daemon's ledger (the harness never writes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _rows(self, q: str, args: tuple = ()) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        db.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in db.execute(q, args)]
        except sqlite3.OperationalError:
            return []  # not created yet
        finally:
            db.close()

    def runs(self, night: str) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM runs WHERE night=? ORDER BY started_at", (night,))

    def phases(self, run_id: str) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM phases WHERE run_id=? ORDER BY started_at", (run_id,))

    def sample_counts(self) -> dict[str, int]:
        return {r["status"]: r["n"] for r in self._rows("SELECT status, COUNT(*) AS n FROM samples GROUP BY status")}

    def versions(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM versions ORDER BY version")

    def trained_by_version(self) -> dict[int, int]:
        rows = self._rows("SELECT version, COUNT(*) AS n FROM samples WHERE status='trained' GROUP BY version")
        return {int(r["version"]): int(r["n"]) for r in rows}


@dataclass
class Answer:
    t: float
    requested: str
    ok: bool
    adapter: str | None = None
    digest: str | None = None
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Client:
    """Asks the server every `interval` s for the newest adapter's completion (the name nightshift
    writes to [hotswap] newest_name_file, as a client of the product does; the base before)."""

    url: str
    newest_file: Path
    prompt: str
    interval: float = 0.5
    answers: list[Answer] = field(default_factory=list)

    def start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            name = self.newest_file.read_text().strip() if self.newest_file.exists() else "base"
            t0 = time.time()
            try:
                status, body = http("POST", self.url + "/v1/completions",
                                    {"model": name, "prompt": self.prompt, "max_tokens": 4}, timeout=60)
                ok = status == 200
                acc = body.get("acceptance", {}) if isinstance(body, dict) else {}
                self.answers.append(Answer(t0, name, ok, acc.get("adapter"), acc.get("logits_digest"),
                                           time.time() - t0, None if ok else f"HTTP {status}: {body}"[:300]))
            except OSError as e:
                self.answers.append(Answer(t0, name, False, seconds=time.time() - t0, error=str(e)[:300]))
            self._stop.wait(self.interval)


class CardSampler:
    """The card's used memory (all processes, NVML) at 2 Hz; absent without a card."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.total: int | None = None
        self.name: str | None = None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self.h)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            self.nvml = None
        if self.nvml is not None:
            threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                m = self.nvml.nvmlDeviceGetMemoryInfo(self.h)
                self.total = int(m.total)
                self.samples.append((time.time(), int(m.used)))
            except Exception:
                pass

    def peak(self, start: float = 0.0, end: float = float("inf")) -> int | None:
        vals = [u for t, u in self.samples if start <= t <= end]
        return max(vals) if vals else None

    def stop(self) -> None:
        self._stop.set()


def python() -> str:
    return sys.executable
