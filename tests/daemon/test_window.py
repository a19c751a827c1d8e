"""Window arithmetic driven by a fake clock: midnight, DST both ways, days, config errors."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from daemon.window import Window, WindowConfig

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
SPRING = date(2026, 3, 29)  # Berlin: 02:00 CET -> 03:00 CEST
FALL = date(2026, 10, 25)  # Berlin: 03:00 CEST -> 02:00 CET


def cfg(start: str, end: str, tz: str = "Europe/Berlin", **kw: object) -> WindowConfig:
    return WindowConfig(start=start, end=end, timezone=tz, **kw)  # type: ignore[arg-type]


def local(day: date, hhmm: str, zone: ZoneInfo = BERLIN, fold: int = 0) -> datetime:
    return datetime.combine(day, time.fromisoformat(hhmm)).replace(tzinfo=zone, fold=fold)


def z(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def hours(w: Window) -> float:
    return (w.end - w.start).total_seconds() / 3600


# -- ordinary nights ---------------------------------------------------------------------------


def test_window_at_and_bounds() -> None:
    c = cfg("01:00", "06:00")
    day = date(2026, 1, 14)
    w = c.window_at(local(day, "03:00"))
    assert w == Window(night="2026-01-14", start=z("2026-01-14T00:00"), end=z("2026-01-14T05:00"))
    assert c.window_at(local(day, "01:00")) == w  # start inclusive
    assert c.window_at(local(day, "05:59:59")) == w
    assert c.window_at(local(day, "06:00")) is None  # end exclusive
    assert c.window_at(local(day, "00:59:59")) is None
    assert w.start.tzinfo is UTC and w.end.tzinfo is UTC
    assert w.deadline(c.save_margin) == z("2026-01-14T04:45")
    assert w.start <= local(day, "02:00") < w.end and not w.start <= local(day, "07:00") < w.end


def test_next_window() -> None:
    c = cfg("01:00", "06:00")
    day = date(2026, 1, 14)
    assert c.next_window(local(day, "00:30")).night == "2026-01-14"
    assert c.next_window(local(day, "03:00")).night == "2026-01-15"  # inside one: the following
    assert c.next_window(local(day, "01:00")).night == "2026-01-15"  # strictly after
    assert c.next_window(local(day, "07:00")).start == z("2026-01-15T00:00")


def test_midnight_crossing() -> None:
    c = cfg("23:00", "06:00")
    assert c.length == timedelta(hours=7)
    jan9, jan10 = date(2026, 1, 9), date(2026, 1, 10)
    w = c.window_at(local(jan10, "02:00"))
    assert w is not None and w.night == "2026-01-09"  # the night is the day it started
    assert (w.start, w.end) == (z("2026-01-09T22:00"), z("2026-01-10T05:00"))
    assert c.window_at(local(jan9, "23:30")) == w
    assert c.window_at(local(jan10, "23:00")).night == "2026-01-10"  # type: ignore[union-attr]
    assert c.window_at(local(jan10, "22:59")) is None
    assert c.next_window(local(jan10, "12:00")).start == local(jan10, "23:00").astimezone(UTC)


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        cfg("01:00", "06:00").window_at(datetime(2026, 1, 1, 3, 0))


# -- DST: spring forward (Berlin 2026-03-29, 02:00 -> 03:00) ------------------------------------


def test_spring_forward_window_containing_the_jump_keeps_wall_clock_end() -> None:
    c = cfg("01:00", "06:00")
    w = c.window_for_night(SPRING)
    assert w is not None and (w.start, w.end) == (z("2026-03-29T00:00"), z("2026-03-29T04:00"))
    assert hours(w) == 4  # the lost hour is lost from the window
    assert c.window_at(local(SPRING, "01:59:59")) == w
    assert c.window_at(local(SPRING, "03:00")) == w  # first minute after the jump
    assert c.window_at(local(SPRING, "06:00")) is None


def test_spring_forward_windows_not_touching_the_jump_are_unchanged() -> None:
    assert hours(cfg("03:00", "06:00").window_for_night(SPRING)) == 3  # type: ignore[arg-type]
    assert hours(cfg("22:00", "01:00").window_for_night(SPRING - timedelta(days=1))) == 3  # type: ignore[arg-type]
    # crossing midnight into the change: 23:00 CET -> 06:00 CEST = 6 real hours
    w = cfg("23:00", "06:00").window_for_night(SPRING - timedelta(days=1))
    assert w is not None and (w.start, w.end) == (z("2026-03-28T22:00"), z("2026-03-29T04:00"))


def test_spring_forward_start_in_gap_shifts_forward() -> None:
    w = cfg("02:30", "05:00").window_for_night(SPRING)
    assert w is not None
    assert w.start == z("2026-03-29T01:30")  # 02:30 does not exist: 03:30 CEST
    assert w.start.astimezone(BERLIN).strftime("%H:%M %Z") == "03:30 CEST"
    assert w.end == z("2026-03-29T03:00")  # 05:00 CEST


def test_spring_forward_end_in_gap_shifts_forward() -> None:
    w = cfg("01:30", "02:30").window_for_night(SPRING)
    assert w is not None and (w.start, w.end) == (z("2026-03-29T00:30"), z("2026-03-29T01:30"))


def test_spring_forward_window_inside_the_gap_still_runs() -> None:
    """02:00–03:00 does not exist that night: it runs anyway, for save margin + minimum run."""
    c = cfg("02:00", "03:00", save_margin_minutes=10, min_run_minutes=20)
    w = c.window_for_night(SPRING)
    assert w is not None and w.start == z("2026-03-29T01:00")  # 03:00 CEST, when the clocks jump
    assert w.end - w.start == timedelta(minutes=30)
    assert c.window_at(local(SPRING, "03:10")) == w
    for d in (SPRING - timedelta(days=1), SPRING + timedelta(days=1)):
        assert hours(c.window_for_night(d)) == 1  # type: ignore[arg-type]


# -- DST: fall back (Berlin 2026-10-25, 03:00 CEST -> 02:00 CET) ---------------------------------


def test_fall_back_window_containing_the_repeat_keeps_wall_clock_end() -> None:
    c = cfg("01:00", "06:00")
    w = c.window_for_night(FALL)
    assert w is not None and (w.start, w.end) == (z("2026-10-24T23:00"), z("2026-10-25T05:00"))
    assert hours(w) == 6
    first, second = local(FALL, "02:30", fold=0), local(FALL, "02:30", fold=1)
    assert second.astimezone(UTC) - first.astimezone(UTC) == timedelta(hours=1)
    assert c.window_at(first) == c.window_at(second) == w  # one night, not two


def test_fall_back_ambiguous_start_is_first_occurrence() -> None:
    c = cfg("02:00", "03:00")
    w = c.window_for_night(FALL)
    assert w is not None
    assert w.start == z("2026-10-25T00:00")  # 02:00 CEST (the first 02:00)
    assert w.end == z("2026-10-25T02:00")  # 03:00 CET
    assert hours(w) == 2
    assert c.window_at(local(FALL, "02:15", fold=1)) == w  # the second 02:15: same night, no rerun
    assert c.next_window(local(FALL, "02:15", fold=1)).night == "2026-10-26"


def test_fall_back_windows_not_touching_the_repeat_are_unchanged() -> None:
    assert hours(cfg("03:00", "06:00").window_for_night(FALL)) == 3  # type: ignore[arg-type]
    assert hours(cfg("20:00", "23:00").window_for_night(FALL)) == 3  # type: ignore[arg-type]


def test_new_york_both_transitions() -> None:
    c = cfg("01:00", "06:00", tz="America/New_York")
    assert hours(c.window_for_night(date(2026, 3, 8))) == 4  # type: ignore[arg-type]
    assert hours(c.window_for_night(date(2026, 11, 1))) == 6  # type: ignore[arg-type]
    w = c.window_for_night(date(2026, 11, 1))
    assert c.window_at(local(date(2026, 11, 1), "01:30", NEW_YORK, fold=1)) == w


@pytest.mark.parametrize("day", [SPRING, FALL])
@pytest.mark.parametrize(
    ("start", "end"),
    [
        ("01:00", "06:00"),
        ("02:00", "03:00"),
        ("02:30", "05:00"),
        ("23:00", "02:30"),
        ("00:00", "04:00"),
        ("01:30", "02:30"),
    ],
)
def test_each_night_runs_exactly_once_around_dst(day: date, start: str, end: str) -> None:
    """Sweep the clock in 5-minute steps over 5 nights: each night's window is met as one
    contiguous stretch, nights come in order, none is missing, none comes back."""
    c = cfg(start, end, save_margin_minutes=5, min_run_minutes=20)
    first, stop = local(day - timedelta(days=2), "12:00"), local(day + timedelta(days=2), "12:00")
    t = first.astimezone(UTC)
    seen: list[str] = []
    prev: str | None = None
    while t < stop:
        w = c.window_at(t)
        night = w.night if w else None
        if night is not None and night != prev:
            assert night not in seen, f"{night} opened twice"
            seen.append(night)
        prev = night
        t += timedelta(minutes=5)  # t is UTC: real minutes, DST or not
    days = (day + timedelta(days=i) for i in range(-3, 4))
    expected = [d.isoformat() for d in days if first <= local(d, start) < stop]
    assert seen == expected


# -- days of the week ----------------------------------------------------------------------------


def test_days_are_the_start_day() -> None:
    c = cfg("23:00", "02:00", days=["mon", "Tuesday"])
    assert c.days == ["mon", "tue"]
    mon, tue, wed, thu = (date(2026, 1, 12) + timedelta(days=i) for i in range(4))
    assert mon.weekday() == 0
    assert c.window_at(local(tue, "01:00")).night == mon.isoformat()  # type: ignore[union-attr]
    assert c.window_at(local(wed, "01:00")).night == tue.isoformat()  # type: ignore[union-attr]
    assert c.window_at(local(thu, "01:00")) is None  # Wednesday's night is not configured
    assert c.window_at(local(wed, "23:30")) is None
    assert c.next_window(local(wed, "03:00")).night == "2026-01-19"  # next Monday
    assert c.window_for_night(wed) is None


def test_days_dedup_and_order() -> None:
    assert cfg("01:00", "06:00", days=["fri", "MON", "friday"]).days == ["mon", "fri"]


# -- describe ------------------------------------------------------------------------------------


def test_describe() -> None:
    assert cfg("01:00", "06:00").describe() == "01:00–06:00 Europe/Berlin"
    assert cfg("01:00", "06:00", days=["sat", "sun"]).describe() == "01:00–06:00 Europe/Berlin sat,sun"


def test_host_zone_when_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import tzlocal

    monkeypatch.setattr(tzlocal, "get_localzone", lambda: ZoneInfo("Asia/Tokyo"))
    c = WindowConfig(start="01:00", end="06:00")
    assert c.timezone is None
    assert c.describe() == "01:00–06:00 Asia/Tokyo"
    assert c.window_for_night(date(2026, 1, 1)).start == z("2025-12-31T16:00")  # type: ignore[union-attr]


# -- config values and errors --------------------------------------------------------------------


def test_accepted_forms() -> None:
    raw = {"start": time(1, 0), "end": " 6:00 ", "timezone": "UTC", "save_margin_minutes": "10", "min_run_minutes": 0.5}
    c = WindowConfig.model_validate(raw)  # a TOML time literal, an env string
    assert (c.start, c.end, c.save_margin_minutes, c.min_run_minutes) == ("01:00", "06:00", 10.0, 0.5)
    s = WindowConfig(start="12:00:05", end="12:01:05", timezone="UTC", save_margin_minutes=0, min_run_minutes=0.5)
    assert s.start == "12:00:05" and s.length == timedelta(minutes=1)  # second resolution, for tests


@pytest.mark.parametrize(
    ("kw", "key", "text"),
    [
        ({"start": "25:00"}, "start", "not a time of day"),
        ({"start": "1am"}, "start", "HH:MM"),
        ({"start": 100}, "start", "expected a time"),
        ({"end": "24:00"}, "end", "00:00"),
        ({"end": "01:00"}, "end", "equals start"),
        ({"end": "01:20"}, "end", "lasts 20 min, less than"),
        ({"timezone": "Europe/Berln"}, "timezone", "unknown time zone"),
        ({"timezone": "../etc/passwd"}, "timezone", "unknown time zone"),
        ({"days": ["mo"]}, "days", "unknown day 'mo'"),
        ({"days": []}, "days", "never opens"),
        ({"days": "mon"}, "days", "expected a list"),
        ({"save_margin_minutes": -1}, "save_margin_minutes", "0 or more"),
        ({"save_margin_minutes": "soon"}, "save_margin_minutes", "number of minutes"),
        ({"min_run_minutes": 0}, "min_run_minutes", "more than 0"),
        ({"min_run_minutes": True}, "min_run_minutes", "number of minutes"),
    ],
)
def test_config_errors_name_the_key(kw: dict[str, object], key: str, text: str) -> None:
    args: dict[str, object] = {"start": "01:00", "end": "06:00", "timezone": "Europe/Berlin", **kw}
    with pytest.raises(ValidationError) as e:
        WindowConfig(**args)  # type: ignore[arg-type]
    msgs = [err["msg"] for err in e.value.errors()]
    assert len(msgs) == 1, msgs
    assert f"[window] {key}:" in msgs[0] and text in msgs[0], msgs[0]


def test_unknown_key_is_refused_with_the_others() -> None:
    with pytest.raises(ValidationError) as e:
        WindowConfig.model_validate({"strat": "01:00", "start": "25:00"})
    assert {(err["loc"], err["type"]) for err in e.value.errors()} == {
        (("strat",), "extra_forbidden"),
        (("start",), "value_error"),
    }


def test_window_too_short_for_a_run() -> None:
    with pytest.raises(ValidationError, match=r"\[window\] end: .*less than save_margin_minutes"):
        cfg("23:50", "00:30", save_margin_minutes=15, min_run_minutes=30)
    assert cfg("23:50", "00:35", save_margin_minutes=15, min_run_minutes=30).length == timedelta(minutes=45)


def test_every_problem_reported_at_once() -> None:
    with pytest.raises(ValidationError) as e:
        WindowConfig(start="x", end="y", timezone="Mars/Base", days=["someday"])
    msgs = " | ".join(err["msg"] for err in e.value.errors())
    for key in ("start", "end", "timezone", "days"):
        assert f"[window] {key}:" in msgs
