"""The wake-up trigger agrees with window_at over a year of DST; WakeScheduler fires and stops."""

from __future__ import annotations

import threading
import time as _time
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from daemon.scheduler import NightlyCronTrigger, WakeScheduler, build_trigger
from daemon.window import DAYS, Window, WindowConfig
from tests.conftest import hang_bound

YEAR_START, YEAR_END = datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)
WINDOWS = [
    ("01:00", "06:00"),
    ("02:00", "03:00"),  # inside the Berlin gap / fold
    ("02:30", "05:00"),  # starts in the gap / fold
    ("01:30", "02:30"),  # ends in the gap / fold (New York: starts in its fold)
    ("23:00", "06:00"),  # crosses midnight and the change
    ("00:00", "04:00"),  # stock CronTrigger skips the day after spring-forward here
]


def fire_times(trigger: CronTrigger, start: datetime, end: datetime) -> list[datetime]:
    out: list[datetime] = []
    fire = trigger.get_next_fire_time(None, start)
    while fire is not None and fire < end:
        out.append(fire)
        fire = trigger.get_next_fire_time(fire, fire)
    return out


def exists(day: date, wall: time, zone: ZoneInfo) -> bool:
    t = datetime.combine(day, wall).replace(tzinfo=zone)
    return t.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == t.replace(tzinfo=None)


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize(("start", "end"), WINDOWS)
def test_a_year_of_fire_times_one_per_night_inside_its_window(tz: str, start: str, end: str) -> None:
    cfg = WindowConfig(start=start, end=end, timezone=tz, save_margin_minutes=5, min_run_minutes=20)
    zone = ZoneInfo(tz)
    fires = fire_times(build_trigger(cfg), YEAR_START, YEAR_END)
    nights = []
    for f in fires:
        w = cfg.window_at(f)
        assert w is not None and w.start == f.astimezone(UTC), f"{f} is not a window start: {w}"
        assert cfg.window_at(f - timedelta(microseconds=1)) != w  # it opens exactly then
        local = f.astimezone(zone)
        assert local.date().isoformat() == w.night
        if exists(local.date(), cfg.start_time, zone):
            assert local.time() == cfg.start_time  # the configured wall clock...
            assert local.utcoffset() == local.replace(fold=0).utcoffset()  # ...first occurrence
        else:
            assert local.time() > cfg.start_time  # ...or shifted forward out of the gap
        nights.append(w.night)
    first = date.fromisoformat(nights[0])
    assert nights == [(first + timedelta(days=i)).isoformat() for i in range(len(nights))]  # no gap, no repeat
    assert len(nights) in (365, 366)


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize(("start", "end"), WINDOWS)
def test_stock_cron_fire_times_are_ours_or_fall_back_repeats(tz: str, start: str, end: str) -> None:
    """Why the trigger computes its own times: stock CronTrigger drops days and repeats hours
    on DST nights. Whatever it fires at that we do not is a fall-back repeat of a night we ran."""
    cfg = WindowConfig(start=start, end=end, timezone=tz, save_margin_minutes=5, min_run_minutes=20)
    st = cfg.start_time
    stock = CronTrigger(hour=st.hour, minute=st.minute, second=st.second, timezone=tz)
    ours = {f.astimezone(UTC) for f in fire_times(build_trigger(cfg), YEAR_START, YEAR_END)}
    for f in fire_times(stock, YEAR_START, YEAR_END):
        if f.astimezone(UTC) not in ours:
            assert f.fold == 1 and cfg.window_at(f) is not None  # the repeat, inside the same night


def test_days_of_week_trigger() -> None:
    cfg = WindowConfig(start="23:30", end="02:00", timezone="Europe/Berlin", days=["fri", "sat"])
    trigger = build_trigger(cfg)
    assert isinstance(trigger, NightlyCronTrigger) and isinstance(trigger, CronTrigger)
    assert "day_of_week='fri,sat'" in str(trigger) and "hour='23'" in str(trigger)
    fires = fire_times(trigger, YEAR_START, YEAR_END)
    assert {DAYS[f.astimezone(ZoneInfo("Europe/Berlin")).weekday()] for f in fires} == {"fri", "sat"}
    assert len(fires) == 104
    assert all(cfg.window_at(f).start == f for f in fires)  # type: ignore[union-attr]


def test_trigger_from_now_is_inclusive_and_from_previous_exclusive() -> None:
    cfg = WindowConfig(start="01:00", end="06:00", timezone="UTC")
    trigger = build_trigger(cfg)
    at = datetime(2026, 5, 1, 1, 0, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, at) == at
    assert trigger.get_next_fire_time(at, at) == at + timedelta(days=1)
    # a previous fire time long ago: the next one after it (APScheduler then handles the misfire)
    assert trigger.get_next_fire_time(at, at + timedelta(days=5)) == at + timedelta(days=1)


# -- WakeScheduler -----------------------------------------------------------------------------

INSIDE = datetime(2026, 1, 14, 2, 0, tzinfo=UTC)  # a fake "now" inside the 01:00–06:00 UTC window
OUTSIDE = datetime(2026, 1, 14, 12, 0, tzinfo=UTC)
CFG = WindowConfig(start="01:00", end="06:00", timezone="UTC")


def eventually(check: Callable[[], bool], timeout: float = 3.0) -> bool:
    """`timeout`: idle-machine seconds, stretched by the load (the scheduler's thread may wait its turn)."""
    end = _time.monotonic() + hang_bound(timeout)
    while not check():
        if _time.monotonic() > end:
            return False
        _time.sleep(0.01)
    return True


class Recorder:
    def __init__(self) -> None:
        self.windows: list[Window] = []
        self.called = threading.Event()

    def __call__(self, w: Window) -> None:
        self.windows.append(w)
        self.called.set()


def test_short_trigger_wakes_with_the_window_of_the_clock() -> None:
    rec = Recorder()
    ws = WakeScheduler(CFG, rec, clock=lambda: INSIDE, trigger=IntervalTrigger(seconds=0.05), catch_up=False)
    ws.start()
    try:
        assert ws.running and ws.next_wake() is not None
        assert rec.called.wait(hang_bound(5))
    finally:
        ws.stop()
    assert not ws.running and ws.next_wake() is None
    assert rec.windows[0] == CFG.window_at(INSIDE) and rec.windows[0].night == "2026-01-14"


def test_wake_outside_a_window_does_not_call_back() -> None:
    rec, asked = Recorder(), threading.Event()

    def clock() -> datetime:
        asked.set()
        return OUTSIDE

    ws = WakeScheduler(CFG, rec, clock=clock, trigger=IntervalTrigger(seconds=0.05), catch_up=False)
    ws.start()
    assert asked.wait(hang_bound(5))
    ws.stop(wait=True)  # lets the job finish
    assert rec.windows == []


def test_catch_up_when_started_inside_a_window() -> None:
    rec = Recorder()
    ws = WakeScheduler(CFG, rec, clock=lambda: INSIDE)  # the real cron trigger: hours away
    ws.start()
    try:
        assert rec.called.wait(hang_bound(5))
        assert rec.windows == [CFG.window_at(INSIDE)]
        expected = CFG.next_window(datetime.now(UTC)).start
        assert eventually(lambda: ws.next_wake() == expected)  # then back on the schedule
    finally:
        ws.stop()


def test_no_catch_up_outside_a_window() -> None:
    rec = Recorder()
    ws = WakeScheduler(CFG, rec, clock=lambda: OUTSIDE)
    ws.start()
    try:
        assert ws.next_wake() == CFG.next_window(datetime.now(UTC)).start
        assert not rec.called.wait(0.3)
    finally:
        ws.stop()


def test_real_clock_window_opening_in_a_second() -> None:
    """End to end: the real trigger and clock, a window opening seconds from now (HH:MM:SS)."""
    opens = (datetime.now(UTC) + timedelta(seconds=3)).replace(microsecond=0)
    cfg = WindowConfig(
        start=opens.strftime("%H:%M:%S"),
        end=(opens + timedelta(minutes=1)).strftime("%H:%M:%S"),
        timezone="UTC",
        save_margin_minutes=0.1,
        min_run_minutes=0.5,
    )
    rec = Recorder()
    ws = WakeScheduler(cfg, rec)
    ws.start()
    try:
        assert ws.next_wake() == opens or datetime.now(UTC) >= opens  # (a very slow start: caught up)
        assert rec.called.wait(hang_bound(10))
    finally:
        ws.stop()
    w = rec.windows[0]
    assert (w.start, w.end, w.night) == (opens, opens + timedelta(minutes=1), opens.date().isoformat())
    assert w.deadline(cfg.save_margin) == opens + timedelta(seconds=54)


def test_start_twice_is_refused_and_stop_is_idempotent() -> None:
    ws = WakeScheduler(CFG, Recorder(), clock=lambda: OUTSIDE)
    ws.start()
    with pytest.raises(RuntimeError):
        ws.start()
    ws.stop()
    ws.stop()
