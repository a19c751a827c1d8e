"""`nightshift run`: the long-running service systemd starts.

One main loop owns everything that must keep going: the systemd watchdog (pinged from
here, so a hung loop is restarted but a long training step is not mistaken for a
hang), the window check, and the supervised night. APScheduler wakes the loop when a
window opens; the ledger, not the scheduler, says whether tonight's run is done, so a
start inside an unfinished window starts (or resumes) the night at once.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from daemon import sdnotify
from daemon.metrics import NightshiftMetrics, serve
from daemon.metrics.from_ledger import refresh_from_ledgers, restore_from_ledgers
from daemon.notify import Notifier
from daemon.preflight import disk_problem
from daemon.report_data import adapter_states
from daemon.scheduler import WakeScheduler
from daemon.settings import Settings
from daemon.supervisor import ChildOutcome, NightChild, night_world, run_id_for, wait_interruptibly
from daemon.window import Window, utcnow
from jobs.contract import ChildEvent, ExitCode, Outcome, PhaseEvent, ProgressEvent, RunSummary
from jobs.gpu.telemetry import free_vram_gb
from jobs.hotswap.versions import resend_if_unheard
from jobs.night.space import night_disk_need_gb
from jobs.store.adapters import Adapters
from jobs.store.ledger import Ledger
from jobs.store.locking import LockTimeout, StateLock, night_lock
from jobs.store.outcomes import NightOutcomes
from jobs.store.paths import StatePaths

log = structlog.get_logger("nightshift.service")
LOCK_RETRY_SECONDS = 2.0  # the night lock is tried this often while another process holds it (a flock: cheap)
STATUS_LOG_SECONDS = 60.0  # the status line goes to systemd at every change, to the log at most this often


def progress_status(ev: ProgressEvent, zone: Any) -> str:
    """'training v0007: 41 %, 1.2 M tokens, eta 02:13' for systemd's STATUS line."""
    eta_text = datetime.fromtimestamp(ev.eta, zone).strftime("%H:%M") if ev.eta else "?"
    amount = f"{ev.tokens / 1e6:.1f} M" if ev.tokens >= 100_000 else f"{ev.tokens / 1e3:.1f} k"
    return f"training v{ev.version or 0:04d}: {100 * ev.fraction:.0f} %, {amount} tokens, eta {eta_text}"


class Service:
    def __init__(self, settings: Settings, *, clock: Callable[[], datetime] = utcnow,
                 registry: CollectorRegistry | None = None, environ: Mapping[str, str] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.s = settings
        self.clock = clock
        self.monotonic = monotonic  # rate limits: watchdog pings, status lines in the log
        self.environ = environ
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.registry = registry or CollectorRegistry()
        sources = ({a.name: list(a.sources) for a in settings.adapters} if settings.adapters  # [[adapters]]
                   else [x.name for x in settings.sources])
        self.metrics = NightshiftMetrics(self.registry, sources=sources,
                                         hotswap_kinds=sorted({t.kind for t in settings.hotswap.targets}),
                                         adapters=[name for name, _ in adapter_states(settings)],  # label values
                                         price_per_gpu_hour=settings.gpu.price_per_gpu_hour)
        self.state = Path(settings.state_dir)
        self.ledger = Ledger(StatePaths(self.state).ledger)
        self.notifier = Notifier(settings.hotswap, self.ledger, background=True)
        self.outcomes = NightOutcomes(self.ledger)
        self.retry_at: dict[str, datetime] = {}
        self.waiting_reason: dict[str, str] = {}
        self.watchdog_interval = sdnotify.watchdog_interval(environ=environ)  # half of WATCHDOG_USEC
        self.tick = min(self.watchdog_interval, 30.0) if self.watchdog_interval else 30.0
        self._last_status = ""
        self._last_ping = -math.inf
        self._status_logged_at = -math.inf

    # ---- systemd -----------------------------------------------------------------------------
    def status(self, text: str) -> None:
        """STATUS= at every change (`systemctl status` shows the latest); the log gets one line a minute."""
        if text != self._last_status:
            self._last_status = text
            sdnotify.status(text, environ=self.environ)
            if self.monotonic() - self._status_logged_at >= STATUS_LOG_SECONDS:
                self._status_logged_at = self.monotonic()
                log.info("status", status=text)

    def ping(self) -> None:
        """WATCHDOG=1 once per half of WATCHDOG_USEC (sd_watchdog_enabled(3)), however often it is called."""
        if self.watchdog_interval is not None and self.ping_due_in() <= 0:
            self._last_ping = self.monotonic()
            sdnotify.watchdog(environ=self.environ)

    def ping_due_in(self) -> float:
        """Seconds until the next watchdog ping is due (the main loop never sleeps past it)."""
        if self.watchdog_interval is None:
            return math.inf
        return self._last_ping + self.watchdog_interval - self.monotonic()

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """One service per state directory: a second exits at once with status 5 (busy)."""
        try:
            lock = StateLock(StatePaths(self.state).daemon_lock, timeout=0, what="nightshift run").__enter__()
        except LockTimeout as e:
            log.error("another_daemon_running", error=str(e))
            print(f"nightshift run: {e}: a service already runs for this state directory", file=sys.stderr)
            return ExitCode.BUSY
        try:
            return self._run()
        finally:
            lock.__exit__(None, None, None)

    def _run(self) -> int:
        w = self.s.window
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._request_stop())
        self._restore_metrics()
        now = self.clock()
        self.metrics.set_window(w.window_at(now) is not None, w.next_window(now).start.timestamp())
        try:
            server = serve(self.s.metrics, self.registry)
        except OSError as e:  # before READY: systemd sees the start fail, with this line
            error = (f"[metrics] address {self.s.metrics.address} port {self.s.metrics.port}: cannot listen: "
                     f"{e.strerror or e}")
            log.error("metrics_failed", error=error)
            print(f"nightshift run: {error}", file=sys.stderr)
            self.ledger.close()
            return ExitCode.USAGE
        sched = WakeScheduler(w, lambda _win: self.wake.set(), clock=self.clock)
        sched.start()
        sdnotify.ready(f"waiting for window {w.describe()}", environ=self.environ)
        threading.Thread(target=self._resend_unheard, name="hotswap-resend", daemon=True).start()
        try:
            while not self.stop.is_set():
                self.ping()
                now = self.clock()
                window, nxt = self._show_window(now)
                if window is not None and self._due(window, now):
                    self._night(window)
                    continue
                if window is None and self._prewarm_due(nxt, now):  # its process starts before the opening
                    self._night(nxt, start_at=nxt.start)
                    continue
                self.status(f"waiting for window {w.describe()}; next {nxt.start.astimezone(w.zone()):%a %H:%M}"
                            if window is None or self.ledger.night_done(window.night)
                            else self._waiting_status(window.night))
                retry = self.retry_at.get(window.night) if window else None
                until_retry = (retry - self.clock()).total_seconds() if retry else self.tick
                until_prewarm = (nxt.start - now).total_seconds() - w.prewarm_seconds
                if until_prewarm <= 0:
                    until_prewarm = self.tick
                self.wake.wait(max(0.05, min(self.tick, until_retry, until_prewarm, self.ping_due_in())))
                self.wake.clear()
        finally:
            sdnotify.stopping("stopping", environ=self.environ)
            self.notifier.join(timeout=10)
            sched.stop(wait=False)
            if server is not None:
                server.close()
            self.ledger.close()
        log.info("stopped")
        return 0

    def _resend_unheard(self) -> None:
        """The version in service, sent again to a target whose last announcement of it failed (a night cut
        in its hot-swap, a server that was down). In a thread: bounded, but a server may take minutes."""
        # [[adapters]]: each adapter's own version in service, to its own targets
        places = [(a.name, a.night.state_dir, a.night.hotswap) for a in self.s.night_config().adapters] or [
            ("", self.state, self.s.hotswap)]
        for name, state, hotswap in places:
            ad = Adapters(state, cfg=self.s.registry)
            try:
                outcomes = resend_if_unheard(ad, hotswap)
                for o in outcomes or []:  # the hot-swap series and alerts see a server still down after a restart
                    self.metrics.on_hotswap(o.kind, o.ok, adapter=name)
                if outcomes is not None:
                    log.info("hotswap.resent_at_start", ok=all(o.ok for o in outcomes), targets=len(outcomes),
                             **({"adapter": name} if name else {}))
            except Exception as e:  # a damaged version, the lock: said, and the service goes on
                log.error("hotswap.resend_failed", error=f"{type(e).__name__}: {e}",
                          **({"adapter": name} if name else {}))
            finally:
                ad.close()

    def _show_window(self, now: datetime) -> tuple[Window | None, Window]:
        """The window open now (or None) and the next one, as the metrics show them."""
        w = self.s.window
        window, nxt = w.window_at(now), w.next_window(now)
        self.metrics.set_window(window is not None, nxt.start.timestamp(), window.end.timestamp() if window else None)
        return window, nxt

    def _tick_in_night(self) -> None:
        """While a night runs: the watchdog, and the window gauges (a prewarmed night starts before its opening)."""
        self.ping()
        self._show_window(self.clock())

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
            lock = self._try_night_lock(window)
            try:
                if lock is None and self.ledger.open_run(window.night) is not None:
                    return False  # the holder runs this very night (a child of ours that outlived us)
                self._close_night(window, "skipped", reason)
            finally:
                if lock is not None:
                    lock.__exit__(None, None, None)
            return False
        return True

    def _prewarm_due(self, window: Window, now: datetime) -> bool:
        """The next window opens within `[window] prewarm_seconds` and its night is due."""
        lead = (window.start - now).total_seconds()
        return 0 < lead <= self.s.window.prewarm_seconds and self._due(window, now)

    def _waiting_status(self, night: str) -> str:
        if night in self.waiting_reason:
            return f"night {night}: waiting: {self.waiting_reason[night]}"
        retry = self.retry_at.get(night)
        return f"night {night}: " + (f"retry at {retry:%H:%M:%S}" if retry else "waiting")

    def _try_night_lock(self, window: Window) -> StateLock | None:
        """The night lock, without waiting (None: `once`, `calibrate` or an older child holds it)."""
        try:
            return night_lock(self.state, what=f"nightshift run: night {window.night}").__enter__()
        except LockTimeout as e:
            reason = f"the state directory is busy ({e})"
            if self.waiting_reason.get(window.night) != reason:
                log.warning("night_waiting_for_lock", night=window.night, error=str(e))
            self.waiting_reason[window.night] = reason
            return None

    def _close_night(self, window: Window, status: str, reason: str, *, count: bool = True) -> None:
        """`count`: also a run in the metrics (not when its failed attempts were already counted)."""
        run_id = self.outcomes.close(window.night, status, reason, deadline=window.end.timestamp())
        row = self.ledger.run(run_id)
        summary = RunSummary(run_id=run_id, night=window.night, outcome=row["status"], error=row["error"],
                             started_at=row["started_at"], ended_at=row["ended_at"])
        if count:
            self.metrics.on_summary(summary)
        log.warning("night_closed", run_id=run_id, night=window.night, status=status, reason=reason)
        self.notifier.night_closed(summary)

    # ---- one night ---------------------------------------------------------------------------
    def _night(self, window: Window, start_at: datetime | None = None) -> None:
        """`start_at`: the window's opening, still ahead: the child imports, then waits for it."""
        lock = self._try_night_lock(window)
        if lock is None:  # retried every few seconds until the latest start; then _due closes the night
            self.retry_at[window.night] = self.clock() + timedelta(seconds=LOCK_RETRY_SECONDS)
            self.status(f"night {window.night}: waiting: {self.waiting_reason[window.night]}")
            return
        try:
            self.waiting_reason.pop(window.night, None)
            self._night_locked(window, lock, start_at)
        finally:
            lock.__exit__(None, None, None)

    def _night_locked(self, window: Window, lock: StateLock, start_at: datetime | None) -> None:
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
        self.status(f"night {window.night}: starting (deadline {deadline.astimezone(zone):%H:%M})" if start_at is None
                    else f"night {window.night}: preparing (the window opens {start_at.astimezone(zone):%H:%M:%S})")

        def on_event(ev: ChildEvent) -> None:
            self.metrics.on_event(ev)
            if isinstance(ev, ProgressEvent):
                self.status(progress_status(ev, zone))
            elif isinstance(ev, PhaseEvent) and ev.state == "start":
                self.status(f"night {window.night}: {ev.phase.value}")

        # every line the daemon logs while this night runs carries its run id (the child's lines too)
        run_id = run_id_for(self.ledger, window.night)
        with structlog.contextvars.bound_contextvars(run_id=run_id, night=window.night):
            child = NightChild(self.s.night_config().model_dump_json(), night=window.night,
                               deadline=deadline.timestamp(), on_event=on_event, lock_fd=lock.fd, run_id=run_id,
                               world=night_world(self.s.train), train=self.s.train,
                               grace=self.s.daemon.stop_grace_seconds,
                               start_at=start_at.timestamp() if start_at else None)
            child.start()
            self.metrics.on_child_start()
            # a child still busy at the window's end is told to stop and save, and killed after the grace
            out = wait_interruptibly(child, self.stop, grace=self.s.daemon.stop_grace_seconds,
                                     on_tick=self._tick_in_night, stop_at=window.end.timestamp(),
                                     clock=lambda: self.clock().timestamp())
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
            if out.summary is not None:
                self.notifier.night_closed(out.summary)  # succeeded, rejected or skipped: closed by the child
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
        writes = night_disk_need_gb(self.s.night_config())  # full fine-tuning: checkpoints of whole models
        problem = disk_problem(self.state, self.s.daemon.min_free_disk_gb + writes)
        if problem is not None:
            return problem
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
        """Backlog and adapter in service from each adapter's ledger (at start and after each night)."""
        refresh_from_ledgers(self.metrics, self.s, self.ledger)

    def _restore_metrics(self) -> None:
        """The last run's series from each adapter's ledger, so a restart blanks no dashboard."""
        restore_from_ledgers(self.metrics, self.s, self.ledger)
