"""Refuse early, in one clear line: `run` checks everything before READY, `check-config` reports every
problem at once, a mistyped environment variable is named, and no user-caused failure is a traceback."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from daemon.settings import ConfigError, load_settings
from jobs.contract import ExitCode
from tests.conftest import REPO, hang_bound, toml_config
from tests.fixtures.daemon_proc import Notify, start, wait_for, write_config


def nightshift(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=hang_bound(timeout), env={**os.environ, **(env or {})})


def one_clear_line(r):
    assert "Traceback" not in r.stderr and r.stderr.strip(), r.stderr
    return r.stderr


# ---- `run` refuses before READY -------------------------------------------------------------------------


def test_run_with_missing_paths_refuses_before_ready(tmp_path, tiny_model):
    cfg, _ = write_config(tmp_path, tiny_model, opens_in=3600)
    text = cfg.read_text().replace(str(tiny_model), str(tmp_path / "no-model"))
    text = text.replace(f'inbox = "{tmp_path / "inbox"}"', f'inbox = "{tmp_path / "no-inbox"}"')
    cfg.write_text(text + f'\n[eval]\nregression_set = "{tmp_path / "no-reg.jsonl"}"\n')
    notify = Notify(tmp_path / "notify.sock")
    daemon = start(cfg, notify)
    try:
        wait_for(lambda: daemon.poll() is not None, 60, "the refusal")
    finally:
        if daemon.poll() is None:
            daemon.kill()
        daemon.wait()  # its stderr read to the end
        notify.close()  # what it sent read too
    err = "".join(daemon.lines)
    assert daemon.returncode == ExitCode.USAGE and "Traceback" not in err
    for key in ("[model] path", "[[sources]] #1 inbox", "[eval] regression_set"):
        assert key in err, err
    assert not notify.having("READY=1")  # systemd sees a failed start, not a service that fails at 01:00


def test_run_with_a_metrics_port_in_use_refuses_before_ready_in_one_line(tmp_path, tiny_model):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cfg, _ = write_config(tmp_path, tiny_model, opens_in=3600)
    cfg.write_text(cfg.read_text().replace("port = 0", f"port = {busy.getsockname()[1]}"))
    notify = Notify(tmp_path / "notify.sock")
    try:
        daemon = start(cfg, notify)
        wait_for(lambda: daemon.poll() is not None, 60, "the refusal")  # its stderr read to the end
    finally:
        busy.close()
        notify.close()
    err = "".join(daemon.lines)
    assert daemon.returncode == ExitCode.USAGE and "cannot listen" in err and "Traceback" not in err
    assert not notify.having("READY=1")


# ---- every problem at once, named as the user writes it --------------------------------------------------


def test_check_config_reports_types_and_paths_together(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[model]\npath = "{tmp_path}/none"\n[train]\nlora_rank = -1\ntokens_per_step = 0\n'
                   f'[[sources]]\nname = "a"\ninbox = "{tmp_path}/nope"\nsettle_seconds = -1\n'
                   '[metrics]\naddress = "999.1.1.1"\n')
    r = nightshift("check-config", str(bad))
    err = one_clear_line(r)
    assert r.returncode == ExitCode.USAGE
    for expected in ("[train] lora_rank", "[train] tokens_per_step", "[[sources]] #1 settle_seconds",
                     "[metrics] address", "[model] path:", "[[sources]] #1 inbox: "):
        assert expected in err, expected


def test_a_mistyped_environment_section_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "n.toml"
    p.write_text('[model]\npath = "m"\n')
    monkeypatch.setenv("NIGHTSHIFT_TRIAN__LORA_RANK", "8")
    monkeypatch.setenv("NIGHTSHIFT_DEPLOY_TOKEN", "a secret named by token_env: not ours to judge")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert "NIGHTSHIFT_TRIAN__LORA_RANK: unknown section 'trian' (did you mean 'train'?)" in e.value.problems
    assert not any("DEPLOY_TOKEN" in x for x in e.value.problems)


def test_malformed_json_in_the_environment_is_one_clear_problem_among_the_others(tmp_path):
    p = tmp_path / "n.toml"
    p.write_text('[model]\npath = "m"\n[train]\nlora_rank = 0\n')
    r = nightshift("check-config", str(p), env={"NIGHTSHIFT_SOURCES": '[{"name": "x", ', "NIGHTSHIFT_EVAL__GATE": "x"})
    err = one_clear_line(r)
    assert r.returncode == ExitCode.USAGE
    assert "NIGHTSHIFT_SOURCES: not valid JSON" in err and "NIGHTSHIFT_EVAL__GATE" in err
    assert "[train] lora_rank" in err  # the rest is still checked


# ---- damaged state, full disks and other user-caused failures: one line -----------------------------------


def test_a_malformed_ledger_is_one_clear_line_for_every_command(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ledger.sqlite").write_bytes(b"garbage " * 1000)
    for cmd in (["status"], ["once"], ["adapters", "list"]):
        r = nightshift("--config", str(cfg), *cmd)
        err = one_clear_line(r)
        assert r.returncode == ExitCode.FAILED and "not a readable nightshift ledger" in err, (cmd, err)
        assert len(err.strip().splitlines()) <= 2, err


def test_once_checks_free_disk_space_before_it_starts(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)
    r = nightshift("--config", str(cfg), "once", env={"NIGHTSHIFT_DAEMON__MIN_FREE_DISK_GB": "1e9"})
    err = one_clear_line(r)
    assert r.returncode == ExitCode.FAILED and "min_free_disk_gb" in err and "GB free" in err
    assert not (tmp_path / "state" / "ledger.sqlite").exists()  # nothing started


def test_a_full_disk_is_one_line_not_a_traceback(tmp_path, tiny_model, monkeypatch, capsys):
    import daemon.status
    from daemon.cli import main

    cfg, _ = toml_config(tmp_path, tiny_model)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "state" / "ledger.sqlite-wal"))

    monkeypatch.setattr(daemon.status, "collect", full)
    assert main(["--config", str(cfg), "status"]) == ExitCode.FAILED
    err = capsys.readouterr().err
    assert err.strip().startswith(f"nightshift status: No space left on device: {tmp_path}/state/ledger.sqlite-wal: "
                                  "free some space on that disk") and len(err.strip().splitlines()) == 1
