"""What `once`, `plan` and `calibrate` show while the child works: a rich bar on a terminal, plain
lines when piped, nothing in JSON mode."""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from daemon.progress import NightProgress, choose_mode, relay, training_text
from jobs.contract import HotswapEvent, HotswapOutcome, Phase, PhaseEvent, ProgressEvent

NOW = 1_795_000_000.0


def night_events(steps: int = 50, seconds_per_step: float = 2.0):
    """A plan-sized night: pull, plan, load, a training of `steps` progress events, evaluate."""
    yield PhaseEvent(phase=Phase.pull, state="start")
    yield PhaseEvent(phase=Phase.pull, state="end", seconds=0.4)
    yield PhaseEvent(phase=Phase.load, state="start")
    yield PhaseEvent(phase=Phase.load, state="end", seconds=3.0)
    yield PhaseEvent(phase=Phase.train, state="start")
    for i in range(1, steps + 1):
        left = (steps - i) * seconds_per_step
        yield ProgressEvent(version=1, fraction=i / steps, tokens=600 * i, planned_tokens=600 * steps, steps=i,
                            tokens_per_second=300.0, eta=NOW + i * seconds_per_step + left)
    yield PhaseEvent(phase=Phase.train, state="end", seconds=steps * seconds_per_step)
    yield HotswapEvent(version=1, outcome=HotswapOutcome(target="vllm", kind="vllm", ok=True, attempts=1))


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


def feed(progress: NightProgress, clock: Clock, seconds_per_step: float = 2.0) -> None:
    with progress:
        for ev in night_events(seconds_per_step=seconds_per_step):
            if isinstance(ev, ProgressEvent):
                clock.t += seconds_per_step
            progress.on_event(ev)


def test_the_mode_follows_the_output():
    assert choose_mode(stream=io.StringIO()) == "lines"
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert choose_mode(stream=tty) == "bar"
    assert choose_mode(stream=tty, log_format="json") == "off"
    assert choose_mode(stream=tty, json_output=True) == "off"


def test_training_text_has_tokens_rate_and_eta():
    done, rate = training_text(ProgressEvent(fraction=0.41, tokens=12_300, planned_tokens=30_000,
                                             tokens_per_second=350.0, eta=NOW + 250), now=NOW)
    assert done == "12.3 k / 30.0 k tokens, 41 %"
    assert rate.startswith("350 tok/s, ETA ") and rate.endswith("(in 4m10s)")


def test_piped_plain_lines_every_tenth_or_minute():
    out, clock = io.StringIO(), Clock()
    feed(NightProgress("lines", stream=out, clock=clock), clock)
    lines = out.getvalue().splitlines()
    assert lines[:4] == ["pull: started", "pull: done in 0.4 s", "load: started", "load: done in 3.0 s"]
    train = [x for x in lines if x.startswith("train: ") and "tok/s" in x]
    # 50 events over 100 s: a line every 10 % (5 events), not one per event
    assert 9 <= len(train) <= 11, train
    assert train[-1].startswith("train: 30.0 k / 30.0 k tokens, 100 %, 300 tok/s, ETA ")
    assert "train: done in 100.0 s" in lines and lines[-1] == "hotswap vllm (vllm): ok after 1 attempt(s)"
    out, clock = io.StringIO(), Clock()  # slow steps: at least one line a minute
    feed(NightProgress("lines", stream=out, clock=clock), clock, seconds_per_step=90.0)
    assert len([x for x in out.getvalue().splitlines() if "tok/s" in x]) == 50


def test_terminal_bar_shows_tokens_rate_and_eta():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=140, color_system=None)
    clock = Clock()
    progress = NightProgress("bar", console=console, clock=clock)
    with progress:
        for ev in night_events():
            if isinstance(ev, ProgressEvent):
                clock.t += 2.0
            progress.on_event(ev)
            if isinstance(ev, ProgressEvent) and ev.steps == 20:
                progress._bar.refresh()  # type: ignore[union-attr]
                live = buf.getvalue()
                assert "train" in live and "12.0 k / 30.0 k tokens, 40 %" in live
                assert "300 tok/s, ETA " in live and "(in 1m00s)" in live
    shown = buf.getvalue()
    assert "pull: done in 0.4 s" in shown and "train: done in 100.0 s" in shown  # finished phases stay


def test_json_mode_prints_nothing():
    out, clock = io.StringIO(), Clock()
    feed(NightProgress("off", stream=out, clock=clock), clock)
    assert out.getvalue() == ""


def test_relay_feeds_events_and_prints_the_rest():
    out = io.StringIO()
    lines = [PhaseEvent(phase=Phase.load, state="start").model_dump_json() + "\n",
             json.dumps({"key": "abc", "tokens_per_step": 8192}) + "\n", "\n"]
    with NightProgress("lines", stream=out, clock=time.time) as p:
        relay(lines, p)
    assert out.getvalue().splitlines() == ["load: started", '{"key": "abc", "tokens_per_step": 8192}']
