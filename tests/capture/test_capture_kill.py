"""kill -9 of `nightshift capture` loses no acknowledged feedback: every acknowledged record is whole in the
inbox, a feedback killed before its acknowledgement leaves nothing half-written, and replies captured before
the kill can still be rated after the restart."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.capture.test_capture import call, chat
from tests.capture.upstream import upstream
from tests.conftest import hang_bound


def start(tmp_path: Path, up: str, crash_at: str | None = None) -> tuple[subprocess.Popen, tuple[str, int]]:
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n[model]\npath = "{tmp_path / "model"}"\n'
                   f'[[sources]]\nname = "inbox"\ninbox = "{tmp_path / "inbox"}"\n')
    env = {**os.environ, "NIGHTSHIFT_LOG_FORMAT": "json"}
    env.pop("NIGHTSHIFT_CRASH_AT", None)
    if crash_at:
        env["NIGHTSHIFT_CRASH_AT"] = crash_at
    p = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config", str(cfg), "capture", "--upstream", up,
                          "--port", "0", "--redact", r"secret-\d+"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    assert p.stdout is not None
    for line in p.stdout:  # bounded by the process: it prints this line or exits
        if "capture_listening" in line:
            port = json.loads(line[line.index("{"):])["port"]
            return p, ("127.0.0.1", int(port))
    raise AssertionError(f"capture exited ({p.wait()}) without listening")


def wait_journal(tmp_path: Path, n: int) -> None:
    journal = tmp_path / "state" / "capture" / "captures.jsonl"
    deadline = time.monotonic() + hang_bound(120)
    while not journal.exists() or len(journal.read_text().splitlines()) < n:
        assert time.monotonic() < deadline, "captures never journaled"
        time.sleep(0.05)


def records(inbox: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(inbox.glob("capture-*.jsonl"))]


@pytest.mark.slow
def test_kill_9_loses_no_acknowledged_feedback(tmp_path):
    inbox = tmp_path / "inbox"
    with upstream() as up:
        p, addr = start(tmp_path, up)
        try:
            for i in range(6):
                assert chat(addr, f"question {i} secret-42")[0] == 200
            wait_journal(tmp_path, 6)
            acked = [json.loads(call(addr, "POST", "/nightshift/feedback", {"id": f"chatcmpl-{i}", "rating": 1})[1])
                     for i in (1, 2, 3)]
            assert all(a["ok"] for a in acked)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        got = records(inbox)
        assert [r["capture_id"] for r in got] == ["chatcmpl-1", "chatcmpl-2", "chatcmpl-3"]  # whole, all of them
        assert all("secret-42" not in json.dumps(r) for r in got)

        # killed inside a feedback, after its record was fsynced under the temporary name: never acknowledged
        p, addr = start(tmp_path, up, crash_at="capture.feedback_before_rename")
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            call(addr, "POST", "/nightshift/feedback", {"id": "chatcmpl-4", "edited": "a better answer"})
        assert p.wait(timeout=hang_bound(120)) == -signal.SIGKILL
        assert len(records(inbox)) == 3 and list(inbox.glob(".capture-*.tmp"))  # not in the inbox's sight

        # restarted: the replies captured before the kills can still get their feedback; the leftover is gone
        p, addr = start(tmp_path, up)
        try:
            status, body, _ = call(addr, "POST", "/nightshift/feedback", {"id": "chatcmpl-4", "edited": "better"})
            assert status == 200, body
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        assert [r["capture_id"] for r in records(inbox)][-1] == "chatcmpl-4"
        assert not list(inbox.glob(".capture-*.tmp"))
