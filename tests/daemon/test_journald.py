"""Logs for journald: when stderr is the journal (JOURNAL_STREAM), every line starts with its syslog
priority (`<3>` error ... `<7>` debug), the night's child's lines too, so `journalctl -p err` works."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import structlog

from jobs.runtime import logs
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl


@pytest.fixture()
def restore_logging():
    """logs.configure changes process-wide state: put it back as it was."""
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    root.handlers, root.level = handlers, level
    structlog.configure(**config)
    logs._state["prefix"] = False


def test_priorities_follow_sd_daemon():
    assert [logs.syslog_priority(x) for x in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                                              logging.CRITICAL)] == [7, 6, 4, 3, 2]


def test_stderr_is_the_journal_only_when_journal_stream_names_it(tmp_path):
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        st = os.fstat(a.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert logs.stream_is_journal(a, env)
        assert not logs.stream_is_journal(b, env)
        assert not logs.stream_is_journal(a, {}) and not logs.stream_is_journal(a, {"JOURNAL_STREAM": "x"})


def test_each_line_starts_with_its_priority_on_the_journal(tmp_path, monkeypatch, restore_logging):
    path = tmp_path / "journal"
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        monkeypatch.delenv(logs.PRIORITY_ENV, raising=False)
        logs.configure("DEBUG", "json", stream=stream)
        log = structlog.get_logger("nightshift.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e")
        logging.getLogger("apscheduler").error("from the standard library")
        assert logs.child_log_env() == {logs.PRIORITY_ENV: "1"}
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<3>"]
    assert json.loads(lines[2][3:])["event"] == "w"
    with open(tmp_path / "plain", "w") as stream:  # not the journal: no prefix, nothing told to the child
        logs.configure("INFO", "json", stream=stream)
        structlog.get_logger("nightshift.test").info("i")
        assert logs.child_log_env() == {}
    assert (tmp_path / "plain").read_text().startswith("{")


@pytest.mark.slow
def test_the_daemon_and_its_child_prefix_every_line_under_systemd(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(5)])
    r, w = os.pipe()
    st = os.fstat(w)
    env = {k: v for k, v in os.environ.items() if k != logs.PRIORITY_ENV}
    env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--config", str(cfg), "plan", "--json"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=w, env=env, text=True)
    os.close(w)
    with os.fdopen(r) as err:
        lines = err.read().splitlines()
    out, _ = proc.communicate(timeout=hang_bound(180))
    assert proc.returncode == 0, lines[-20:]
    assert json.loads(out)["train_ids"]
    assert lines and all(re.match(r"<[2-7]>\{", line) for line in lines), [x for x in lines if x[:1] != "<"][:5]
    loggers = {json.loads(line[3:]).get("logger") for line in lines}
    assert "nightshift.supervisor" in loggers  # the daemon's own line
    assert "nightshift.night" in loggers  # the child's, relayed: it was told to prefix
