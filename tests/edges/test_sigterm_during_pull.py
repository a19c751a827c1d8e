"""Issue 40: a stop request (SIGTERM, as systemd sends it) during a long pull stops the pull between two
chunks, keeps every file committed before it, and the night ends without waiting for the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from jobs.contract import ExitCode
from jobs.store.readonly import open_read_only
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl

pytestmark = pytest.mark.slow
FILES, PER_FILE = 120, 200  # 24,000 records: a pull of many seconds on 2 cores


def test_sigterm_during_a_long_pull_stops_it_and_keeps_what_was_ingested(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    for f in range(FILES):
        p = write_jsonl(inbox / f"f{f:03d}.jsonl", [alpaca(f * PER_FILE + i) for i in range(PER_FILE)])
        os.utime(p, (1000 + f, 1000 + f))
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "once"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NIGHTSHIFT_LOG_FORMAT": "json"})
    ingested = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if '"file_ingested"' in line:
                ingested.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert ingested.wait(hang_bound(600)), "".join(lines[-30:])
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=hang_bound(600))  # bounds a hang only; what is asserted is where the pull stopped
    finally:
        proc.kill()
    reader.join(timeout=hang_bound(30))  # its last lines (pull_stopped) read, not a moment later
    assert proc.returncode == ExitCode.INTERRUPTED, "".join(lines[-30:])
    led = open_read_only(tmp_path / "state" / "ledger.sqlite")
    files = led.db.execute("SELECT COUNT(*), COALESCE(SUM(accepted), 0) FROM files").fetchone()
    assert 1 <= files[0] < FILES, f"{files[0]} of {FILES} files read: the pull did not stop"
    assert led.backlog()[0] == files[1] == files[0] * PER_FILE  # what was committed is kept, whole files only
    assert led.sample_counts().get("trained", 0) == 0
    stopped = [json.loads(x) for x in lines if '"pull_stopped"' in x]
    assert stopped and stopped[0]["files"] == files[0]
