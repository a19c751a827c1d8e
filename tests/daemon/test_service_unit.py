"""The daemon's decisions with a fake clock: pre-flight waits, too-late starts, retry backoff."""

import json
from datetime import UTC, datetime, timedelta

import pytest

import daemon.service as service_mod
from daemon.service import Service
from daemon.settings import load_settings
from daemon.supervisor import ChildOutcome
from jobs.store.ledger import Ledger
from tests.conftest import hang_bound


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


# ---- systemd and the log: watchdog pings, status lines ------------------------------------------------

class Mono:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def service_with(tmp_path, environ, mono, more=""):
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n[model]\npath = "{tmp_path}"\n{more}')
    return Service(load_settings(cfg), clock=lambda: datetime(2026, 11, 21, 12, 0, tzinfo=UTC), environ=environ,
                   monotonic=mono)


@pytest.fixture()
def restore_logging():
    import logging

    import structlog

    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    root.handlers, root.level = handlers, level
    structlog.configure(**config)


@pytest.fixture()
def notify_socket(tmp_path):
    import socket

    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)

    got: list[str] = []

    def received():  # everything so far (drain often: a datagram queue holds only a few)
        while True:
            try:
                got.append(sock.recv(4096).decode())
            except BlockingIOError:
                return got

    yield path, received
    sock.close()


def test_watchdog_pings_twice_per_watchdog_usec_however_often_the_loop_ticks(tmp_path, notify_socket):
    path, received = notify_socket
    mono = Mono()
    svc = service_with(tmp_path, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000"}, mono)
    for _ in range(1200):  # 4 minutes of a night: the supervisor's wait ticks every 0.2 s
        svc.ping()
        received()
        mono.t += 0.2
    pings = [m for m in received() if m == "WATCHDOG=1"]
    assert len(pings) == 24  # one per 10 s (half of WATCHDOG_USEC), not 1200
    assert svc.ping_due_in() <= 10  # the main loop sleeps no longer than that
    quiet = service_with(tmp_path, {"NOTIFY_SOCKET": path}, mono)  # no watchdog asked for: no pings
    quiet.ping()
    assert len(received()) == 24 and quiet.ping_due_in() == float("inf")


def test_status_goes_to_systemd_at_every_change_and_to_the_log_once_a_minute(tmp_path, notify_socket, capsys,
                                                                              restore_logging):
    from jobs.runtime import logs

    path, received = notify_socket
    mono = Mono()
    svc = service_with(tmp_path, {"NOTIFY_SOCKET": path}, mono)
    logs.configure("INFO", "json")
    for i in range(300):  # 10 minutes of progress, a new status every 2 s
        svc.status(f"training v0001: {i // 3} %")
        received()
        mono.t += 2.0
    assert len([m for m in received() if m.startswith("STATUS=")]) == 100  # every change (3 ticks per %)
    logged = [json.loads(x) for x in capsys.readouterr().err.splitlines() if '"status"' in x]
    assert 10 <= len(logged) <= 11 and all(x["event"] == "status" for x in logged)


def test_a_closed_night_notifies_its_webhook_subscribers(tmp_path, servers):
    from tests.fixtures.lora_servers import start

    srv = start(servers, "webhook")
    svc = service_with(tmp_path, {}, Mono(), more=f"""
[[hotswap.targets]]
kind = "webhook"
name = "ops"
url = "{srv.url}/hook"
events = ["skipped", "failed"]
""")
    window = svc.s.window.next_window(datetime(2026, 11, 21, 12, 0, tzinfo=UTC))
    svc._close_night(window, "skipped", "too late to start")
    svc.notifier.join(timeout=hang_bound(10))
    [req] = srv.posts("/hook")
    body = json.loads(req["raw"])
    assert body["event"] == "skipped" and body["night"] == window.night and body["error"] == "too late to start"
    assert body["run_id"].startswith(f"{window.night}-skipped")


# ---- the night's process starts before the window opens (its imports take ~30 s on a GPU host) -------

def test_the_nights_process_starts_prewarm_seconds_before_the_window_and_waits_for_its_opening(make, monkeypatch):
    monkeypatch.setattr(service_mod, "free_vram_gb", lambda device: 80.0)
    started = []

    class FakeChild:
        def __init__(self, *a, **kw):
            started.append(kw)

        def start(self):
            return 1

    monkeypatch.setattr(service_mod, "NightChild", FakeChild)
    monkeypatch.setattr(service_mod, "wait_interruptibly", lambda *a, **kw: ChildOutcome(0, None))
    monkeypatch.setattr(Service, "_after", lambda self, window, out: None)
    svc, clock = make(datetime(2026, 11, 21, 0, 58, tzinfo=UTC))  # the window opens at 01:00, prewarm 90 s
    upcoming = svc.s.window.next_window(clock["now"])
    assert svc.s.window.window_at(clock["now"]) is None and not svc._prewarm_due(upcoming, clock["now"])
    clock["now"] = datetime(2026, 11, 21, 0, 58, 40, tzinfo=UTC)
    assert svc._prewarm_due(upcoming, clock["now"])
    svc._night(upcoming, start_at=upcoming.start)
    assert started[0]["start_at"] == upcoming.start.timestamp() and started[0]["night"] == upcoming.night
    assert "preparing (the window opens 01:00:00)" in svc._last_status
    monkeypatch.setattr(svc.ledger, "night_done", lambda night: True)  # a night done is not prewarmed again
    assert not svc._prewarm_due(upcoming, clock["now"])


def test_prewarm_0_starts_the_night_at_the_opening(make):
    svc, clock = make(datetime(2026, 11, 21, 0, 59, 59, tzinfo=UTC))
    svc.s.window.prewarm_seconds = 0
    assert not svc._prewarm_due(svc.s.window.next_window(clock["now"]), clock["now"])
