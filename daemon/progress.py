"""What `once`, `plan` and `calibrate` show while the night's child works.

Three modes, chosen by `choose_mode`:
- `bar` (stdout is a terminal): a rich live display: the phase running now and, while training,
  a bar with tokens done of the plan's tokens, tok/s and the ETA to the plan's end; finished
  phases stay above it with their seconds; log lines scroll above it too.
- `lines` (piped): plain event lines: each phase's start and end, a training line every 10 % or
  every minute (and at the end), hot-swap outcomes.
- `off` (JSON: `[log] format = "json"`, or a command's `--json`): nothing but the JSON log.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Literal, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn

from jobs.contract import ChildEvent, HotswapEvent, OomSplitEvent, PhaseEvent, ProgressEvent, parse_event

Mode = Literal["bar", "lines", "off"]
LINE_EVERY_SECONDS = 60.0  # `lines`: a training line at least this often...
LINE_EVERY_FRACTION = 0.1  # ...or every 10 % of the plan


def choose_mode(*, json_output: bool = False, log_format: str = "auto", stream: TextIO | None = None) -> Mode:
    if json_output or log_format == "json":
        return "off"
    return "bar" if (stream or sys.stdout).isatty() else "lines"


def _amount(tokens: float) -> str:
    return f"{tokens / 1e6:.2f} M" if tokens >= 1e6 else f"{tokens / 1e3:.1f} k" if tokens >= 1e3 else f"{tokens:.0f}"


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def training_text(ev: ProgressEvent, now: float) -> tuple[str, str]:
    """('12.3 k / 30.0 k tokens, 41 %', '350 tok/s, ETA 02:13:05 (in 4m10s)')"""
    planned = f" / {_amount(ev.planned_tokens)}" if ev.planned_tokens else ""
    done = f"{_amount(ev.tokens)}{planned} tokens, {100 * ev.fraction:.0f} %"
    eta = "ETA ?"
    if ev.eta is not None:
        eta = f"ETA {datetime.fromtimestamp(ev.eta).astimezone():%H:%M:%S} (in {_duration(ev.eta - now)})"
    return done, f"{ev.tokens_per_second:,.0f} tok/s, {eta}"


class NightProgress:
    """Feed it the child's events (`on_event`); use as a context manager around the child's life."""

    def __init__(self, mode: Mode, *, stream: TextIO | None = None, clock: Callable[[], float] = time.time,
                 console: Console | None = None) -> None:
        self.mode, self.clock = mode, clock
        self.stream = stream or sys.stdout
        self.console = console or Console(file=self.stream, highlight=False)
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._last_line = (0.0, -1.0)  # (time, fraction) of the last `lines` training line
        self._swapped: list[tuple[logging.StreamHandler, object]] = []

    # ---- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> NightProgress:
        if self.mode == "bar":
            self._bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[done]}"), TextColumn("{task.fields[rate]}"),
                                 console=self.console, transient=True, redirect_stderr=True, redirect_stdout=False)
            self._bar.start()
            self._route_logs_above()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        for handler, stream in self._swapped:
            handler.setStream(stream)  # type: ignore[arg-type]
        self._swapped.clear()

    def _route_logs_above(self) -> None:
        """Log handlers writing to the terminal write through rich's proxy, above the live display."""
        proxy = sys.stderr  # rich's FileProxy while the display is live (redirect_stderr)
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is sys.__stderr__ and proxy is not h.stream:
                self._swapped.append((h, h.stream))
                h.setStream(proxy)

    # ---- output --------------------------------------------------------------------------------
    def print(self, text: str) -> None:
        """A block of text (a table) above the display, or as is."""
        try:
            if self._bar is not None:
                self._bar.console.print(text, highlight=False, markup=False)
            else:
                print(text, file=self.stream, flush=True)
        except BrokenPipeError:  # the reader left (`once | head -1`): the night goes on, shown no more
            self.mode = "off"

    def on_event(self, ev: ChildEvent) -> None:
        if self.mode == "off":
            return
        if isinstance(ev, PhaseEvent):
            self._phase(ev)
        elif isinstance(ev, ProgressEvent):
            self._training(ev)
        elif isinstance(ev, HotswapEvent):
            o = ev.outcome
            self._line(f"hotswap {o.target} ({o.kind}): " + ("ok" if o.ok else f"FAILED: {o.error}")
                       + f" after {o.attempts} attempt(s)")
        elif isinstance(ev, OomSplitEvent):
            self._line(f"train: a {ev.tokens}-token step ran out of GPU memory: every step now runs in two halves")

    def _line(self, text: str) -> None:
        if self.mode == "lines" or self._bar is not None:
            self.print(text)

    def _phase(self, ev: PhaseEvent) -> None:
        name = ev.phase.value
        if ev.state == "end":
            self._line(f"{name}: done in {ev.seconds or 0:.1f} s")
            if self._bar is not None and self._task is not None:
                self._bar.remove_task(self._task)
                self._task = None
            return
        if self._bar is None:
            self._line(f"{name}: started")
            return
        if self._task is not None:
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(name, total=None, done="", rate="")

    def _training(self, ev: ProgressEvent) -> None:
        now = self.clock()
        done, rate = training_text(ev, now)
        if self._bar is not None:
            if self._task is None:
                self._task = self._bar.add_task("train", total=None, done="", rate="")
            total = ev.planned_tokens or None
            completed = ev.tokens if total else ev.fraction
            self._bar.update(self._task, total=total or 1.0, completed=completed, done=done, rate=rate)
            return
        last_t, last_f = self._last_line
        if ev.fraction >= 1.0 or ev.fraction - last_f >= LINE_EVERY_FRACTION or now - last_t >= LINE_EVERY_SECONDS:
            self._last_line = (now, ev.fraction)
            self._line(f"train: {done}, {rate}")


def relay(lines: Iterable[str], progress: NightProgress) -> None:
    """A child's stdout: event lines feed the display, anything else is printed as it is."""
    for line in lines:
        try:
            ev = parse_event(line)
        except ValueError:
            if line.strip():
                progress.print(line.rstrip("\n"))
            continue
        progress.on_event(ev)
