"""Wake-up at the window start: APScheduler 3.11, rebuilt from config at every daemon start.

Why this shape:
- MemoryJobStore only: the job is built from `[window]` each start, never unpickled, so a
  renamed function or a changed window can not silently keep (or drop) an old schedule.
- The scheduler only says "a window may have opened". `on_wake` gets the `Window`
  containing the current time and must ask the ledger whether that night's run is done;
  the scheduler's memory is never trusted for that (it is lost at every restart anyway).
- `NightlyCronTrigger` fires exactly at each `Window.start`, with the DST rule of
  `daemon.window` (stock CronTrigger gets DST nights wrong: see the class).
- max_instances=1 + coalesce: a slow callback or a suspended host never stacks wake-ups;
  misfire_grace_time = the window length: a wake-up that is late but still inside the
  window still happens (`on_wake` then finds the window by itself).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import structlog
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger

from daemon.window import Window, WindowConfig, utcnow

log = structlog.get_logger("nightshift.scheduler")
JOB_ID = "nightshift-wake"
_US = timedelta(microseconds=1)


class NightlyCronTrigger(CronTrigger):
    """A CronTrigger on the window start whose fire times are the `Window.start`s themselves.

    Its cron fields (what `str()` and APScheduler's logs show) are the window start, but
    the stock 3.11 algorithm is wrong on DST nights, so fire times come from
    `WindowConfig` (the same arithmetic as `window_at`):
    - it skips a whole day after spring-forward for starts before the change, e.g. 00:00
      Europe/Berlin fires 03-29 then 03-31 in 2026 (agronholm/apscheduler#606, #529);
    - it fires twice in the hour repeated by fall-back (02:30 CEST, then 02:30 CET).
    tests/test_scheduler.py walks a year of fire times (Berlin, New York) against window_at.
    """

    def __init__(self, cfg: WindowConfig) -> None:
        st = cfg.start_time
        super().__init__(
            day_of_week=",".join(cfg.days) if cfg.days else "*",
            hour=st.hour,
            minute=st.minute,
            second=st.second,
            timezone=cfg.zone(),
        )
        self.window_cfg = cfg

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        # APScheduler's contract: the first fire time >= `now`, or the first one after
        # `previous_fire_time` (a past one too: the scheduler applies misfire grace and coalesce).
        if previous_fire_time is None:
            return self.window_cfg.next_window(now - _US).start.astimezone(self.timezone)
        return self.window_cfg.next_window(previous_fire_time).start.astimezone(self.timezone)


def build_trigger(cfg: WindowConfig) -> NightlyCronTrigger:
    """Cron trigger at the window start (hour/minute/second, day_of_week, timezone)."""
    return NightlyCronTrigger(cfg)


class WakeScheduler:
    """Calls `on_wake(window)` when a window opens (and at start, if started inside one).

    `on_wake` runs on the scheduler's single worker thread: keep it short (hand the night
    to the main loop, e.g. through a queue). `clock` decides which window a wake-up belongs
    to (tests inject a fake); `trigger` replaces the cron trigger (tests use a short one).
    """

    def __init__(
        self,
        cfg: WindowConfig,
        on_wake: Callable[[Window], None],
        *,
        clock: Callable[[], datetime] = utcnow,
        trigger: BaseTrigger | None = None,
        catch_up: bool = True,
    ) -> None:
        self.cfg = cfg
        self.on_wake = on_wake
        self.clock = clock
        self.trigger = trigger if trigger is not None else build_trigger(cfg)
        self.catch_up = catch_up
        self._scheduler: BackgroundScheduler | None = None

    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def start(self) -> None:
        if self._scheduler is not None:
            raise RuntimeError("WakeScheduler already started")
        sched = BackgroundScheduler(
            jobstores={"default": MemoryJobStore()},
            executors={"default": ThreadPoolExecutor(max_workers=1)},
            timezone=self.cfg.zone(),
        )
        inside = self.catch_up and self.cfg.window_at(self.clock()) is not None
        extra = {"next_run_time": utcnow()} if inside else {}  # fire once now, then on the trigger
        sched.add_job(
            self._fire,
            self.trigger,
            id=JOB_ID,
            name=f"wake for window {self.cfg.describe()}",
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, int(self.cfg.length.total_seconds())),
            replace_existing=True,
            **extra,
        )
        sched.start()
        self._scheduler = sched
        log.info("scheduler started", window=self.cfg.describe(), next_wake=_iso(self.next_wake()), catch_up=inside)

    def stop(self, wait: bool = True) -> None:
        """Stop waking; with `wait`, let a running `on_wake` return first."""
        if self._scheduler is not None:
            if self._scheduler.running:
                self._scheduler.shutdown(wait=wait)
            self._scheduler = None

    def next_wake(self) -> datetime | None:
        """UTC time of the next wake-up (None when stopped)."""
        if self._scheduler is None:
            return None
        job = self._scheduler.get_job(JOB_ID)
        t = job.next_run_time if job is not None else None
        return t.astimezone(UTC) if t is not None else None

    def _fire(self) -> None:
        now = self.clock()
        window = self.cfg.window_at(now)
        if window is None:  # e.g. a custom trigger, or a wake-up later than the window
            log.info(
                "woke outside the window; waiting for the next",
                now=_iso(now),
                next_window=_iso(self.cfg.next_window(now).start),
            )
            return
        log.info(
            "window open",
            night=window.night,
            start=_iso(window.start),
            end=_iso(window.end),
            deadline=_iso(window.deadline(self.cfg.save_margin)),
        )
        self.on_wake(window)


def _iso(t: datetime | None) -> str | None:
    return t.astimezone(UTC).isoformat() if t is not None else None


__all__ = ["JOB_ID", "NightlyCronTrigger", "WakeScheduler", "build_trigger"]
