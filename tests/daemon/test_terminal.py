"""At a terminal, one stream: the plan, progress and summary; the structured log elsewhere (issue 42)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading

from daemon.terminal import LogTee, at_terminal, warning_line
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_only_once_and_plan_at_a_tty_with_the_default_format_move_the_logs():
    assert at_terminal("once", "auto", {}, Tty()) and at_terminal("plan", "auto", {}, Tty())
    assert not at_terminal("once", "auto", {}, io.StringIO())  # piped, CI, systemd: logs on stderr as before
    assert not at_terminal("run", "auto", {}, Tty())  # the service
    assert not at_terminal("once", "console", {}, Tty()) and not at_terminal("once", "auto", {
        "NIGHTSHIFT_LOG_FORMAT": "json"}, Tty())  # asked for


def test_the_tee_keeps_every_line_and_shows_only_warnings_and_errors():
    file, term = io.StringIO(), io.StringIO()
    tee = LogTee(file, term)
    info = json.dumps({"event": "child_started", "level": "info", "pid": 1})
    warn = json.dumps({"event": "bytecode_missing", "level": "warning", "modules": 83, "run_id": "r"})
    tee.write(info + "\n" + warn[:10])
    tee.write(warn[10:] + "\nnot json\n")
    assert file.getvalue() == info + "\n" + warn + "\nnot json\n"
    assert term.getvalue() == "warning: bytecode_missing (modules=83)\n" and not tee.isatty()
    assert warning_line(json.dumps({"event": "slow_step", "level": "info"})) is None


def test_a_warning_is_one_short_line():
    """A quarantined record's warning took three terminal lines (`line=None`, the whole detail): short, the rest
    in the log file."""
    rec = {"event": "file_not_read", "level": "warning", "source": "s", "file": "/srv/inbox/locked.jsonl",
           "line": None, "detail": "not read this time (Permission denied); tried again at the next pull " * 3}
    line = warning_line(json.dumps(rec))
    assert line is not None and line.startswith("warning: file_not_read (source=s file=/srv/inbox/locked.jsonl ")
    assert "None" not in line and len(line) <= 160 < len(json.dumps(rec)) and line.endswith("…")


def test_plan_at_a_terminal_prints_the_plan_without_log_lines_or_a_pull(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(6)])
    main, child = os.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NIGHTSHIFT_LOG_FORMAT"}
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "plan"], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=env)
    os.close(child)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert proc.wait(timeout=hang_bound(300)) == 0
    reader.join(timeout=hang_bound(30))
    os.close(main)
    text = b"".join(chunks).decode(errors="replace")
    assert "new samples to train" in text  # the plan
    for noise in ("child_started", "imported", "step_shape", "pull: started", "pull: done", '"level"'):
        assert noise not in text, (noise, text[-3000:])
    assert not (tmp_path / "state").exists()  # a plan at a terminal writes no log file either
