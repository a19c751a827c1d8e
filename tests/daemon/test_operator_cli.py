"""The little things a service owes its operator: --version, help for everything, exit codes written
down, where the config comes from, and `nightshift config --print | --schema`. No night runs here."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest

from daemon.cli import build_parser
from daemon.cli_help import EXIT_CODE_MEANINGS
from daemon.config_cli import CONFIG_ENV, leaves, resolve_config_path, schema, to_toml
from daemon.settings import ConfigError, load_settings
from jobs.contract import ExitCode, nightshift_version
from tests.conftest import REPO, hang_bound


def nightshift(*args, cwd=REPO, env=None):
    full_env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    full_env.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run([sys.executable, "-m", "daemon", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=hang_bound(120), env=full_env)


def test_version_and_every_exit_code_in_the_help_and_the_readme():
    r = nightshift("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"nightshift {nightshift_version()}"
    r = nightshift("--help")
    assert r.returncode == 0
    assert "The `nightshift` command line." not in r.stdout and "continual fine-tuning" in r.stdout
    readme = (REPO / "README.md").read_text()
    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)
    for code in ExitCode:
        assert re.search(rf"^\s+{int(code)}\s+{re.escape(EXIT_CODE_MEANINGS[code][:30])}", r.stdout, re.M), code
        assert re.search(rf"\|\s*`{int(code)}`\s*\|", readme), f"exit code {int(code)} is not in the README"
    for command in ("validate", "report", "config"):
        assert command in r.stdout


def _actions(parser: argparse.ArgumentParser, path: str = "nightshift"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_and_argument_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _actions(build_parser())
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"no help: {missing}"


def test_config_is_found_by_flag_then_environment_then_working_directory_then_etc(tmp_path):
    system = tmp_path / "etc" / "nightshift.toml"
    local = tmp_path / "work" / "config" / "nightshift.toml"
    assert resolve_config_path(Path("x.toml"), {CONFIG_ENV: "/y.toml"}) == (Path("x.toml"), "--config")
    assert resolve_config_path(None, {CONFIG_ENV: "/y.toml"}, cwd=tmp_path) == (Path("/y.toml"), CONFIG_ENV)
    with pytest.raises(ConfigError) as e:
        resolve_config_path(None, {}, cwd=tmp_path / "work", system=system)
    assert CONFIG_ENV in str(e.value) and str(system) in str(e.value) and "config/nightshift.toml" in str(e.value)
    system.parent.mkdir(parents=True)
    system.write_text("")
    assert resolve_config_path(None, {}, cwd=tmp_path / "work", system=system) == (system, "system")
    local.parent.mkdir(parents=True)
    local.write_text("")
    assert resolve_config_path(None, {}, cwd=tmp_path / "work", system=system) == (local, "working directory")


def test_status_works_from_any_directory_with_nightshift_config_and_prints_the_path(tmp_path):
    cfg = tmp_path / "n.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n[model]\npath = "{tmp_path}"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = nightshift("status", cwd=elsewhere, env={CONFIG_ENV: str(cfg)})
    assert r.returncode == 0, r.stderr
    assert re.search(rf"config\s+{re.escape(str(cfg))} \({CONFIG_ENV}\)", r.stdout)
    r = nightshift("status", "--json", cwd=elsewhere, env={CONFIG_ENV: str(cfg)})
    assert json.loads(r.stdout)["config"] == f"{cfg} ({CONFIG_ENV})"
    r = nightshift("status", cwd=elsewhere)  # no flag, no variable, no ./config here (and no /etc file)
    if not Path("/etc/nightshift/nightshift.toml").exists():
        assert r.returncode == ExitCode.USAGE and "no config file" in r.stderr and CONFIG_ENV in r.stderr


def test_config_print_says_where_each_value_came_from_and_loads_back(tmp_path, monkeypatch):
    cfg = tmp_path / "n.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / "state"}"
[model]
path = "{tmp_path}"
[[sources]]
name = "a"
inbox = "{tmp_path}"
field_map = {{question = "instruction", "odd key" = "output"}}
[train]
lora_rank = 8
[[eval.gate]]
data = "heldout"
metric = "accuracy"
max_worse = 0.01
[[hotswap.targets]]
kind = "webhook"
name = "hook"
url = "https://example.invalid/x"
events = ["rejected", "failed"]
""")
    monkeypatch.setenv("NIGHTSHIFT_TRAIN__LEARNING_RATE", "0.0005")
    s = load_settings(cfg)
    raw = tomllib.loads(cfg.read_text())
    origin = {k: src for k, _v, src in leaves(s, raw)}
    assert origin["train.lora_rank"] == "file" and origin["train.lora_alpha"] == "default"
    assert origin["train.learning_rate"] == "environment: NIGHTSHIFT_TRAIN__LEARNING_RATE"
    assert origin["sources[0].field_map"] == "file" and origin["sources[0].settle_seconds"] == "default"
    assert origin["hotswap.targets[0].events"] == "file" and origin["hotswap.targets[0].retries"] == "default"
    text = to_toml(s, raw)
    assert re.search(r"^lora_rank = 8\s+# file$", text, re.M)
    assert re.search(r"^learning_rate = 0.0005\s+# environment: NIGHTSHIFT_TRAIN__LEARNING_RATE$", text, re.M)
    assert re.search(r"^# max_samples = \(not set\)\s+# default$", text, re.M)
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    monkeypatch.delenv("NIGHTSHIFT_TRAIN__LEARNING_RATE")
    assert load_settings(printed).model_dump() == s.model_dump()  # the resolved config, whole

    r = nightshift("--config", str(cfg), "config", "--print", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["train.lora_rank"] == {"value": 8, "source": "file"}


def test_config_schema_needs_no_config_and_validates_the_shipped_ones(tmp_path):
    r = nightshift("config", "--schema", cwd=tmp_path)  # no config anywhere: the schema needs none
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads(json.dumps(schema()))
    jsonschema.Draft202012Validator.check_schema(doc)
    for name in ("nightshift.toml", "workstation.example.toml"):
        jsonschema.validate(tomllib.loads((REPO / "config" / name).read_text()), doc)
    bad = {"model": {"path": "x"}, "train": {"lora_rank": "sixteen", "lora_rnak": 8}}
    errors = list(jsonschema.Draft202012Validator(doc).iter_errors(bad))
    assert {tuple(e.path) for e in errors} >= {("train",), ("train", "lora_rank")}
