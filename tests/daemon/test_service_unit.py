"""The daemon's decisions with a fake clock: pre-flight waits, too-late starts, retry backoff."""

from datetime import UTC, datetime, timedelta

import pytest

import daemon.service as service_mod
from daemon.service import Service
from daemon.settings import load_settings
from daemon.supervisor import ChildOutcome
from jobs.store.ledger import Ledger


@pytest.fixture()
def make(tmp_path, monkeypatch):
    def build(now, **daemon):
        cfg = tmp_path / "n.toml"
        extra = "".join(f"{k} = {v}\n" for k, v in daemon.items())
        cfg.write_text(f"""
state_dir = "{tmp_path / 'state'}"
[model]
path = "{tmp_path}"
[window]
start = "01:00"
end = "06:00"
timezone = "UTC"
save_margin_minutes = 15
min_run_minutes = 30
[gpu]
min_free_vram_gb = 20
[daemon]
retry_backoff_seconds = 60
{extra}""")
        clock = {"now": now}
        svc = Service(load_settings(cfg), clock=lambda: clock["now"])
        return svc, clock

    return build


def test_too_little_free_vram_waits_then_skips_the_night_with_that_reason(make, monkeypatch):
    monkeypatch.setattr(service_mod, "free_vram_gb", lambda device: 12.5)
    svc, clock = make(datetime(2026, 11, 21, 1, 0, tzinfo=UTC))
    window = svc.s.window.window_at(clock["now"])
    assert svc._due(window, clock["now"])
    svc._night(window)  # pre-flight: not enough VRAM, no child started
    assert "only 12.5 GB of GPU memory free (need 20 GB)" in svc.waiting_reason[window.night]
    assert not svc._due(window, clock["now"])  # waits for the retry
    clock["now"] = datetime(2026, 11, 21, 5, 20, tzinfo=UTC)  # past the latest start (06:00 - 15 - 30 min)
    assert not svc._due(window, clock["now"])
    led = Ledger(svc.state / "ledger.sqlite")
    [run] = led.db.execute("SELECT * FROM runs WHERE night=?", (window.night,)).fetchall()
    assert run["status"] == "skipped" and "12.5 GB" in run["error"] and "too late to start" in run["error"]
    assert svc.ledger.night_done(window.night)


def test_a_crash_is_retried_with_doubling_backoff_then_closed(make):
    svc, clock = make(datetime(2026, 11, 21, 1, 0, tzinfo=UTC), max_attempts=3)
    window = svc.s.window.window_at(clock["now"])
    crash = ChildOutcome(-9, None, ["last line"])
    svc._after(window, crash)
    assert svc.retry_at[window.night] == clock["now"] + timedelta(seconds=60)
    svc._after(window, crash)
    assert svc.retry_at[window.night] == clock["now"] + timedelta(seconds=120)
    svc._after(window, crash)
    [run] = svc.ledger.db.execute("SELECT * FROM runs WHERE night=?", (window.night,)).fetchall()
    assert run["status"] == "failed" and "3 attempts failed" in run["error"] and "SIGKILL" in run["error"]


def test_the_child_is_stopped_at_the_windows_end_with_its_grace():
    import threading

    from daemon.supervisor import wait_interruptibly

    class FakeChild:
        def __init__(self):
            self.stopped_with = None

        def running(self):
            return self.stopped_with is None

        def stop(self, grace):
            self.stopped_with = grace
            return ChildOutcome(3, {"outcome": "interrupted"})

        def wait(self):
            raise AssertionError("not reached")

    child, now, ticks = FakeChild(), [100.0], []

    def tick():
        ticks.append(now[0])
        now[0] += 10

    out = wait_interruptibly(child, threading.Event(), grace=42, poll=0.001, on_tick=tick, stop_at=130.0,
                             clock=lambda: now[0])
    assert child.stopped_with == 42 and out.returncode == 3 and ticks == [100.0, 110.0, 120.0]
