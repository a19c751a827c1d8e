"""Quiet on a closed pipe, for every command (issue 42): `nightshift plan | head -1` and `once | head -1` killed
the event reader (its error log itself raised), so the night's result never arrived: `plan` said "failed (exit
status 0)" and `once` closed a night that had promoted its version with a second, failed run row;
`config --schema | head -1` printed a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from daemon.progress import NightProgress
from daemon.supervisor import NightChild
from jobs.contract import ExitCode, Outcome, Phase, PhaseEvent, ResultEvent, RunSummary
from tests.conftest import alpaca, hang_bound, toml_config, write_jsonl

REPO = Path(__file__).resolve().parents[2]


class ClosedPipe:
    """A stdout whose reader has gone: every write is EPIPE."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


class FakeChild:
    def __init__(self, lines: list[bytes]) -> None:
        self.stdout = lines


def test_a_failing_event_handler_does_not_stop_the_reading_and_the_result_arrives():
    seen: list[str] = []

    def handler(ev: object) -> None:
        seen.append(type(ev).__name__)
        raise BrokenPipeError(32, "Broken pipe")

    child = NightChild("{}", night="2026-11-21", deadline=0.0, on_event=handler)
    events = [PhaseEvent(phase=Phase.pull, state="start"), PhaseEvent(phase=Phase.pull, state="end", seconds=0.1),
              ResultEvent(summary=RunSummary(run_id="r", night="2026-11-21", outcome=Outcome.succeeded, version=3))]
    child.proc = FakeChild([ev.model_dump_json().encode() + b"\n" for ev in events])  # type: ignore[assignment]
    child._read_events()
    assert seen == ["PhaseEvent", "PhaseEvent", "ResultEvent"]
    assert child.summary is not None and child.summary.version == 3


def test_progress_into_a_closed_pipe_goes_quiet():
    progress = NightProgress("lines", stream=ClosedPipe())  # type: ignore[arg-type]
    with progress:
        progress.on_event(PhaseEvent(phase=Phase.pull, state="start"))
        progress.on_event(PhaseEvent(phase=Phase.pull, state="end", seconds=0.1))
        progress.print("a table")
    assert progress.mode == "off"


def closed_stdout(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """The command with its stdout's reader gone before it writes a byte (as `| head -1` after one line)."""
    p = subprocess.Popen([sys.executable, "-m", "daemon", *argv], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read()
    return subprocess.CompletedProcess(argv, p.wait(timeout=hang_bound(600)), "", err)


def test_config_schema_into_a_closed_pipe_is_quiet(tmp_path):
    r = closed_stdout("config", "--schema")
    assert (r.returncode, r.stderr) == (0, "")


def test_plan_into_a_closed_pipe_is_quiet(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(8)])
    r = closed_stdout("--config", str(cfg), "plan")
    assert "Traceback" not in r.stderr and "failed" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_command_keeps_its_exit_status_when_its_reader_leaves(tmp_path, monkeypatch):
    """`once | head -1` after a failed or interrupted night: the summary's write found no reader and the command
    ended 0 halfway through; now what is left is written nowhere and the status is the night's."""
    from daemon.preflight import one_line

    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = open(write_end, "w", buffering=1)  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", stdout)

    def night_summary() -> int:
        print("night:\n" + "a summary line\n" * 1000)
        print("the rest")
        return ExitCode.INTERRUPTED

    try:
        assert one_line("once", night_summary) == ExitCode.INTERRUPTED
        assert sys.stdout is stdout  # given back as it was
        assert os.path.samefile(f"/proc/self/fd/{write_end}", os.devnull)  # the rest went nowhere
    finally:
        stdout.close()


def test_validate_into_a_closed_pipe_still_says_a_record_would_be_quarantined(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(f'{{"instruction": "q{i}", "output": "a"}}\n' for i in range(500)) + "{not json\n")
    r = closed_stdout("validate", str(bad))
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == ExitCode.FAILED, r.stderr[-3000:]


class ExitedChild:
    """A child that has exited; what it wrote is still in the pipe."""

    def __init__(self, lines: list[bytes]) -> None:
        self.stdout, self.pid = lines, 1

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_the_result_behind_a_slow_handler_still_arrives_after_the_child_exits():
    """The child wrote its result and exited while a handler still held an earlier event (a blocked terminal,
    sd_notify): the reader had 5 s after the exit, then the result was lost and a night that succeeded was counted
    failed. Now the wait hands on everything the child wrote; the handler here holds the first event for 6 s."""
    import threading

    release = threading.Event()
    seen: list[str] = []

    def slow(ev: object) -> None:
        if not seen:
            release.wait(hang_bound(60))
        seen.append(type(ev).__name__)

    child = NightChild("{}", night="2026-11-21", deadline=0.0, on_event=slow)
    events = [PhaseEvent(phase=Phase.pull, state="start"),
              ResultEvent(summary=RunSummary(run_id="r", night="2026-11-21", outcome=Outcome.succeeded, version=3))]
    child.proc = ExitedChild([ev.model_dump_json().encode() + b"\n" for ev in events])  # type: ignore[assignment]
    child._threads = [threading.Thread(target=child._read_events, daemon=True),
                      threading.Thread(target=lambda: None, daemon=True)]  # its log reader: nothing to read
    for t in child._threads:
        t.start()
    threading.Timer(6.0, release.set).start()  # past the old 5-s join
    out = child.wait()
    assert seen == ["PhaseEvent", "ResultEvent"]
    assert out.summary is not None and out.summary.version == 3 and out.returncode == 0
