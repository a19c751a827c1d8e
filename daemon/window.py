"""The nightly window: when a night's run may happen, as UTC instants, DST included.

`[window]` gives local wall-clock times ("01:00"–"06:00") in an IANA zone. Everything
downstream (deadline, scheduler, ledger) works on aware UTC instants, so the wall clock
is turned into instants here, once, by one rule:

- A window belongs to the *night* of the local date it starts on (`Window.night`, ISO
  date): the ledger keys "is tonight's run done?" on it. `days` filters that start date.
- Wall-clock times are resolved with PEP 495 `fold=0` (daemon.scheduler's trigger fires
  at exactly these `Window.start`s):
  * a time that does not exist (spring forward, e.g. 02:30 in Berlin on 2026-03-29)
    shifts forward by the gap, like a clock nobody moved: 02:30 -> 03:30 CEST;
  * a time that happens twice (fall back, e.g. 02:30 in Berlin on 2026-10-25) means
    the first occurrence (summer time).
- Hence a night when the clocks change keeps its wall-clock end: 01:00–06:00 lasts 4 h
  in spring and 6 h in autumn. If the jump eats (nearly) all of a window (02:00–03:00
  on a spring-forward night), it lasts `save_margin_minutes + min_run_minutes` from its
  start instead: a night is never skipped. A window never reaches into the next
  night's window either, so at most one window contains any instant: never twice.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # index = date.weekday()
_FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_TIME_RE = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


def _key(name: str) -> str:
    return f"[window] {name}"


@dataclass(frozen=True)
class Window:
    """One night's window. `start`/`end` are aware UTC datetimes; compare only those."""

    night: str  # ISO date of the local day the window starts on: the ledger's key
    start: datetime
    end: datetime

    def deadline(self, save_margin: timedelta) -> datetime:
        """When training must stop to have the adapter saved before `end`."""
        return self.end - save_margin


class WindowConfig(BaseModel):
    """[window]: local start/end ("HH:MM", or "HH:MM:SS" for tests), zone, days it may start on."""

    model_config = ConfigDict(extra="forbid")
    start: str = "01:00"
    end: str = "06:00"
    timezone: str | None = None  # IANA name; None = the host's zone (tzlocal)
    days: list[str] | None = None  # weekdays the window may START on; None = every day
    save_margin_minutes: float = 15.0  # stop training this long before `end` to save
    min_run_minutes: float = 30.0  # a window with less time than this to train is not worth starting
    # the night's process starts this long before the window opens: its imports (Unsloth's take ~30 s on an
    # H100/H200 host) are done when the window opens, where its data is pulled and its first step follows
    prewarm_seconds: float = Field(90.0, ge=0, le=900)  # more would hold the night lock and the card for long

    @field_validator("start", "end", mode="before")
    @classmethod
    def _wall_time(cls, v: Any, info: ValidationInfo) -> str:
        name = _key(str(info.field_name))
        if isinstance(v, time):  # TOML local time literal: start = 01:00:00
            if v.tzinfo is not None or v.microsecond:
                raise ValueError(f'{name}: give a plain local time like "01:00", got {v.isoformat()}')
            return _fmt(v)
        if not isinstance(v, str):
            raise ValueError(f'{name}: expected a time like "01:00", got {v!r}')
        m = _TIME_RE.match(v.strip())
        if not m:
            raise ValueError(f'{name}: expected a time like "01:00" (HH:MM, 24 h), got {v!r}')
        h, mi, s = int(m[1]), int(m[2]), int(m[3] or 0)
        if h == 24 and mi == 0 and s == 0:
            raise ValueError(f'{name}: "24:00" is not a time of day; use "00:00" (midnight)')
        if h > 23 or mi > 59 or s > 59:
            raise ValueError(f"{name}: {v!r} is not a time of day (00:00 to 23:59)")
        return _fmt(time(h, mi, s))

    @field_validator("timezone", mode="before")
    @classmethod
    def _zone(cls, v: Any) -> str | None:
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f'{_key("timezone")}: expected an IANA zone name like "Europe/Berlin", got {v!r}')
        try:
            ZoneInfo(v.strip())
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f'{_key("timezone")}: unknown time zone {v!r}; use an IANA name like "Europe/Berlin", '
                '"America/New_York" or "UTC" (leave it out for the host\'s zone)'
            ) from None
        return v.strip()

    @field_validator("days", mode="before")
    @classmethod
    def _days(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str) or not isinstance(v, list | tuple):
            raise ValueError(f'{_key("days")}: expected a list like ["mon", "tue"], got {v!r}')
        out: list[str] = []
        for d in v:
            name = d.strip().lower() if isinstance(d, str) else d
            if name in _FULL_DAYS:
                name = DAYS[_FULL_DAYS.index(name)]
            if name not in DAYS:
                raise ValueError(f"{_key('days')}: unknown day {d!r}; use {', '.join(DAYS)}")
            if name not in out:
                out.append(name)
        if not out:
            raise ValueError(f"{_key('days')}: an empty list never opens the window; leave it out for every day")
        return sorted(out, key=DAYS.index)

    @field_validator("save_margin_minutes", "min_run_minutes", mode="before")
    @classmethod
    def _minutes(cls, v: Any, info: ValidationInfo) -> float:
        name = _key(str(info.field_name))
        if isinstance(v, str):  # from the environment: NIGHTSHIFT_WINDOW__MIN_RUN_MINUTES=30
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{name}: expected a number of minutes, got {v!r}") from None
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
            raise ValueError(f"{name}: expected a number of minutes, got {v!r}")
        if info.field_name == "min_run_minutes" and not v > 0:
            raise ValueError(f"{name}: must be more than 0 minutes, got {v!r}")
        if v < 0:
            raise ValueError(f"{name}: must be 0 or more minutes, got {v!r}")
        return float(v)

    @model_validator(mode="after")
    def _long_enough(self) -> WindowConfig:
        length = self.length
        if length == timedelta(0):
            raise ValueError(f"{_key('end')}: equals start ({self.start}); the window would be empty")
        need = self.save_margin + self.min_run
        if length < need:
            raise ValueError(
                f"{_key('end')}: the window {self.start}–{self.end} lasts {_minutes_text(length)}, less than "
                f"save_margin_minutes ({self.save_margin_minutes:g}) + min_run_minutes "
                f"({self.min_run_minutes:g}) = {_minutes_text(need)}; move start or end, or lower those"
            )
        return self

    # -- derived values -------------------------------------------------------------------------

    @property
    def start_time(self) -> time:
        return time.fromisoformat(self.start)

    @property
    def end_time(self) -> time:
        return time.fromisoformat(self.end)

    @property
    def length(self) -> timedelta:
        """Wall-clock length (DST nights differ: see the module docstring)."""
        s, e = (_seconds(t) for t in (self.start_time, self.end_time))
        return timedelta(seconds=(e - s) % 86400)

    @property
    def save_margin(self) -> timedelta:
        return timedelta(minutes=self.save_margin_minutes)

    @property
    def min_run(self) -> timedelta:
        return timedelta(minutes=self.min_run_minutes)

    def zone(self) -> tzinfo:
        """The configured zone, or the host's (tzlocal) when none is configured."""
        if self.timezone is not None:
            return ZoneInfo(self.timezone)
        import tzlocal

        return tzlocal.get_localzone()

    def zone_name(self) -> str:
        z = self.zone()
        return str(getattr(z, "key", None) or z)

    def describe(self) -> str:
        """For STATUS lines and logs: "01:00–06:00 Europe/Berlin" (+ " mon,tue" with days)."""
        text = f"{self.start}–{self.end} {self.zone_name()}"
        return f"{text} {','.join(self.days)}" if self.days else text

    # -- the window arithmetic (pure: `now` is injected) ----------------------------------------

    def window_for_night(self, night: date) -> Window | None:
        """The window starting on local date `night`, or None if `days` excludes that day."""
        if self.days is not None and DAYS[night.weekday()] not in self.days:
            return None
        zone = self.zone()
        start = _resolve(night, self.start_time, zone)
        end_day = night if self.end_time > self.start_time else night + timedelta(days=1)
        end = _resolve(end_day, self.end_time, zone)
        end = max(end, start + self.save_margin + self.min_run)  # the spring-forward jump ate it
        next_start = _resolve(night + timedelta(days=1), self.start_time, zone)
        end = min(end, next_start)  # never overlap the next night (only near-24 h windows)
        return Window(night=night.isoformat(), start=start, end=end)

    def window_at(self, now: datetime) -> Window | None:
        """The window containing `now` (start inclusive, end exclusive), or None."""
        now = _utc(now)
        today = now.astimezone(self.zone()).date()
        for back in range(3):  # a window lasts < 1 day, so it started today or yesterday
            w = self.window_for_night(today - timedelta(days=back))
            if w is not None and w.start <= now < w.end:
                return w
        return None

    def next_window(self, now: datetime) -> Window:
        """The first window starting strictly after `now` (the one after the current, if inside one)."""
        now = _utc(now)
        today = now.astimezone(self.zone()).date()
        for ahead in range(-1, 9):
            w = self.window_for_night(today + timedelta(days=ahead))
            if w is not None and w.start > now:
                return w
        raise AssertionError("unreachable: every week has a window day")  # pragma: no cover


def utcnow() -> datetime:
    """The daemon's default clock (aware, UTC); tests pass their own."""
    return datetime.now(UTC)


def _utc(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"need an aware datetime, got naive {now!r}")
    return now.astimezone(UTC)


def _resolve(day: date, wall: time, zone: tzinfo) -> datetime:
    """Local wall time -> UTC instant; fold=0: nonexistent shifts forward, ambiguous = first."""
    return datetime.combine(day, wall).replace(tzinfo=zone, fold=0).astimezone(UTC)


def _seconds(t: time) -> int:
    return t.hour * 3600 + t.minute * 60 + t.second


def _fmt(t: time) -> str:
    return t.strftime("%H:%M:%S" if t.second else "%H:%M")


def _minutes_text(d: timedelta) -> str:
    return f"{d.total_seconds() / 60:g} min"


# ---- `once` / `plan --until`: a manual window's end -----------------------------------------------------

UNTIL_FORMS = "HH:MM or HH:MM:SS (local time), or +N with s, min or h from now (+90min, +2h)"
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def until_arg(until: str) -> str:
    """argparse's check of --until: a malformed one is a bad command line (exit status 2, with the usage)."""
    try:
        parse_until(until, 0, dt.datetime.now().astimezone())
    except SystemExit as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--until: ")) from None
    return until


def parse_until(until: str | None, default_seconds: float, now: dt.datetime) -> float:
    """--until HH:MM[:SS] (local time, the next such moment), +N[s|min|h] (from now), or now + default;
    unix seconds."""
    if until is None:
        return now.timestamp() + default_seconds
    if until.startswith("+"):
        number = until[1:].rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = until[1 + len(number):]  # required: is "+90" seconds or minutes?
        try:
            seconds = float(number) * _UNITS[unit]
        except (KeyError, ValueError):
            seconds = -1.0
        if not seconds > 0 or seconds == float("inf"):
            raise SystemExit(f"--until: expected {UNTIL_FORMS}, got {until!r}")
        return now.timestamp() + seconds
    try:
        parts = [int(x) for x in until.split(":")]
        if len(parts) not in (2, 3):
            raise ValueError
        t = now.replace(hour=parts[0], minute=parts[1], second=parts[2] if len(parts) == 3 else 0, microsecond=0)
    except ValueError:
        raise SystemExit(f"--until: expected {UNTIL_FORMS}, got {until!r}") from None
    if t <= now:
        t += dt.timedelta(days=1)
    return t.timestamp()
