"""`nightshift run`: the long-running service systemd starts.

One main loop owns everything that must keep going: the systemd watchdog (pinged from
here, so a hung loop is restarted but a long training step is not mistaken for a
hang), the window check, and the supervised night. APScheduler wakes the loop when a
window opens; the ledger, not the scheduler, says whether tonight's run is done, so a
start inside an unfinished window starts (or resumes) the night at once.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from daemon import sdnotify
from daemon.metrics import NightshiftMetrics, serve
from daemon.scheduler import WakeScheduler
from daemon.settings import Settings
from daemon.supervisor import ChildOutcome, NightChild, night_world, wait_interruptibly
from daemon.window import Window, utcnow
from jobs.contract import ChildEvent, Outcome, PhaseEvent, ProgressEvent, RunSummary
from jobs.gpu import free_vram_gb
from jobs.store.ledger import Ledger
from jobs.store.locking import LockTimeout, StateLock
from jobs.store.outcomes import NightOutcomes
from jobs.store.registry import Registry

log = structlog.get_logger("nightshift.service")


def progress_status(ev: ProgressEvent, zone: Any) -> str:
    """'training v0007: 41 %, 1.2 M tokens, eta 02:13' for systemd's STATUS line."""
    eta_text = datetime.fromtimestamp(ev.eta, zone).strftime("%H:%M") if ev.eta else "?"
    amount = f"{ev.tokens / 1e6:.1f} M" if ev.tokens >= 100_000 else f"{ev.tokens / 1e3:.1f} k"
    return f"training v{ev.version or 0:04d}: {100 * ev.fraction:.0f} %, {amount} tokens, eta {eta_text}"


class Service:
    def __init__(self, settings: Settings, *, clock: Callable[[], datetime] = utcnow,
                 registry: CollectorRegistry | None = None, environ: Mapping[str, str] | None = None) -> None:
        self.s = settings
        self.clock = clock
        self.environ = environ
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.registry = registry or CollectorRegistry()
        self.metrics = NightshiftMetrics(self.registry, sources=[x.name for x in settings.sources],
                                         hotswap_kinds=sorted({t.kind for t in settings.hotswap.targets}))
        self.state = Path(settings.state_dir)
        self.ledger = Ledger(self.state / "ledger.sqlite")
        self.outcomes = NightOutcomes(self.ledger)
        self.retry_at: dict[str, datetime] = {}
        self.waiting_reason: dict[str, str] = {}
        interval = sdnotify.watchdog_interval(environ=environ)
        self.tick = min(interval, 30.0) if interval else 30.0
        self._last_status = ""

    # ---- systemd -----------------------------------------------------------------------------
    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            sdnotify.status(text, environ=self.environ)
            log.info("status", status=text)

    def ping(self) -> None:
        sdnotify.watchdog(environ=self.environ)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            with StateLock(self.state / "daemon.lock", timeout=0, what="nightshift run"):
                return self._run()
        except LockTimeout as e:
            log.error("another_daemon_running", error=str(e))
            return 1

    def _run(self) -> int:
        w = self.s.window
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._request_stop())
        self._restore_metrics()
        now = self.clock()
        self.metrics.set_window(w.window_at(now) is not None, w.next_window(now).start.timestamp())
        server = serve(self.s.metrics, self.registry)
        sched = WakeScheduler(w, lambda _win: self.wake.set(), clock=self.clock)
        sched.start()
        sdnotify.ready(f"waiting for window {w.describe()}", environ=self.environ)
        try:
            while not self.stop.is_set():
                self.ping()
                now = self.clock()
                window = w.window_at(now)
                nxt = w.next_window(now)
                self.metrics.set_window(window is not None, nxt.start.timestamp(),
                                        window.end.timestamp() if window else None)
                if window is not None and self._due(window, now):
                    self._night(window)
                    continue
                self.status(f"waiting for window {w.describe()}; next {nxt.start.astimezone(w.zone()):%a %H:%M}"
                            if window is None or self.ledger.night_done(window.night)
                            else f"night {window.night}: retry at {self.retry_at[window.night]:%H:%M:%S}")
                retry = self.retry_at.get(window.night) if window else None
                until_retry = (retry - self.clock()).total_seconds() if retry else self.tick
                self.wake.wait(max(0.05, min(self.tick, until_retry)))
                self.wake.clear()
        finally:
            sdnotify.stopping("stopping", environ=self.environ)
            sched.stop(wait=False)
            if server is not None:
                server.close()
            self.ledger.close()
        log.info("stopped")
        return 0

    def _request_stop(self) -> None:
        self.stop.set()
        self.wake.set()

    def _due(self, window: Window, now: datetime) -> bool:
        if self.ledger.night_done(window.night):
            return False
        retry = self.retry_at.get(window.night)
        if retry is not None and now < retry:
            return False
        latest_start = window.deadline(self.s.window.save_margin) - self.s.window.min_run
        if now > latest_start:
            reason = (f"too late to start: less than {self.s.window.min_run_minutes:g} min of the window left "
                      "to train")
            if window.night in self.waiting_reason:
                reason = f"{self.waiting_reason.pop(window.night)} until the latest start; {reason}"
            self._close_night(window, "skipped", reason)
            return False
        return True

    def _close_night(self, window: Window, status: str, reason: str, *, count: bool = True) -> None:
        """`count`: also a run in the metrics (not when its failed attempts were already counted)."""
        run_id = self.outcomes.close(window.night, status, reason, deadline=window.end.timestamp())
        row = self.ledger.run(run_id)
        if count:
            self.metrics.on_summary(RunSummary(run_id=run_id, outcome=status, error=reason,
                                               started_at=row["started_at"], ended_at=row["ended_at"]))
        log.warning("night_closed", night=window.night, status=status, reason=reason)

    # ---- one night ---------------------------------------------------------------------------
    def _night(self, window: Window) -> None:
        problem = self._preflight()
        if problem:
            self._close_night(window, "skipped", problem)
            return
        waiting = self._gpu_wait(window)
        if waiting:  # retried until the latest start; then _due closes the night with this reason
            self.waiting_reason[window.night] = waiting
            self.retry_at[window.night] = self.clock() + timedelta(seconds=self.s.gpu.preflight_retry_seconds)
            self.status(f"night {window.night}: waiting: {waiting}")
            return
        deadline = window.deadline(self.s.window.save_margin)
        zone = self.s.window.zone()
        self.status(f"night {window.night}: starting (deadline {deadline.astimezone(zone):%H:%M})")

        def on_event(ev: ChildEvent) -> None:
            self.metrics.on_event(ev)
            if isinstance(ev, ProgressEvent):
                self.status(progress_status(ev, zone))
            elif isinstance(ev, PhaseEvent) and ev.state == "start":
                self.status(f"night {window.night}: {ev.phase.value}")

        child = NightChild(self.s.night_config().model_dump_json(), night=window.night,
                           deadline=deadline.timestamp(), on_event=on_event, world=night_world(self.s.train),
                           train=self.s.train, grace=self.s.daemon.stop_grace_seconds)
        child.start()
        self.metrics.on_child_start()
        # a child still busy at the window's end is told to stop and save, and killed after the grace
        out = wait_interruptibly(child, self.stop, grace=self.s.daemon.stop_grace_seconds, on_tick=self.ping,
                                 stop_at=window.end.timestamp(), clock=lambda: self.clock().timestamp())
        self.metrics.on_child_exit()
        self._after(window, out)
        self._refresh_metrics()

    def _after(self, window: Window, out: ChildOutcome) -> None:
        outcome = out.summary.outcome if out.summary else None
        if self.stop.is_set() and outcome in (None, "interrupted"):
            log.info("night_paused_for_shutdown", night=window.night)  # resumed by the next start
            return
        if outcome == "interrupted":  # stopped at the window's end before finishing: close it
            self._close_night(window, "failed", "the window ended before the run finished")
            return
        if not out.crashed and outcome != "failed":
            self.retry_at.pop(window.night, None)
            return
        error = (out.summary.error if out.summary else None) or f"the night's process died ({out.describe_exit()})"
        if out.summary is None:
            self.outcomes.attempt_failed(window.night, error, out.tail)
            self.metrics.on_summary(RunSummary(outcome=Outcome.failed, error=error, ended_at=self.clock().timestamp()))
        failures = self.outcomes.failures(window.night)
        log.error("night_attempt_failed", night=window.night, failures=failures, error=error,
                  tail=out.tail[-10:])
        if failures >= self.s.daemon.max_attempts:
            self._close_night(window, "failed", f"{failures} attempts failed; last: {error}", count=False)
            return
        delay = self.s.daemon.retry_backoff_seconds * 2 ** (failures - 1)
        self.retry_at[window.night] = self.clock() + timedelta(seconds=delay)

    def _preflight(self) -> str | None:
        """Why the night cannot start now, or None."""
        self.state.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(self.state).free / 1e9
        if free_gb < self.s.daemon.min_free_disk_gb:
            return f"only {free_gb:.1f} GB free in {self.state} (need {self.s.daemon.min_free_disk_gb:g} GB)"
        try:
            night_world(self.s.train)
        except ValueError as e:  # more cards asked than this host has
            return str(e)
        return None

    def _gpu_wait(self, window: Window) -> str | None:
        """Not enough free VRAM yet (an inference server may hold some at night): retry later."""
        need = self.s.gpu.min_free_vram_gb
        if need <= 0:
            return None
        free = free_vram_gb(self.s.gpu.device)
        if free is None:
            return f"no GPU visible (need {need:g} GB free VRAM)"
        if free >= need:
            return None
        return f"only {free:.1f} GB of GPU memory free (need {need:g} GB)"

    def _refresh_metrics(self) -> None:
        """Backlog and adapter in service from the ledger (at start and after each night)."""
        self.metrics.set_backlog(*self.ledger.backlog())
        version = Registry(self.state).current_version()
        row = self.ledger.version(version) if version else None
        if row is not None:
            manifest = json.loads(row["manifest"] or "{}")
            self.metrics.set_adapter_in_service(version, row["name"],
                                                manifest.get("base_model", {}).get("path", ""))

    def _restore_metrics(self) -> None:
        runs = self.ledger.last_runs(50)
        finished = [r for r in runs if r["ended_at"]]
        success = next((r["ended_at"] for r in finished if r["status"] == "succeeded"), None)
        last = finished[0] if finished else None
        self.metrics.restore(last_success=success, last_run=last["ended_at"] if last else None,
                             last_outcome=last["status"] if last else None)
        self._refresh_metrics()
