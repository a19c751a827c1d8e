"""Paths in a config file are relative to the file, and no read-only command creates or changes a state
directory (issue 42: `cd /elsewhere && nightshift --config /path/nightshift.toml status` created ./state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.settings import load_settings
from tests.conftest import alpaca, run, write_jsonl

READ_ONLY = [["status"], ["status", "--json"], ["plan", "--json"], ["report", "--json"], ["doctor"],
             ["adapters", "list"], ["adapters", "show", "tiny-v0001"], ["adapters", "diff", "tiny-v0001", "tiny-v0001"],
             ["validate", "INBOX/a.jsonl"], ["config", "--print"], ["check-config"]]


def tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under the roots, with size and mtime (SQLite companions included: none may appear)."""
    return {str(p): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for root in roots if root.exists() for p in sorted(root.rglob("*"))}


def cli(cfg: Path, argv: list[str]) -> None:
    try:
        main(["--config", str(cfg), *(a.replace("INBOX", str(cfg.parent / "inbox")) for a in argv)])
    except SystemExit as e:  # an argparse error is a broken test, not a read-only command's answer
        raise AssertionError(f"{argv}: exit {e.code}") from None


@pytest.fixture
def relative_config(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config whose state dir and inbox are written relative to it, in a folder that is not the cwd."""
    home = tmp_path / "ns"
    (home / "inbox").mkdir(parents=True)
    write_jsonl(home / "inbox" / "a.jsonl", [alpaca(i) for i in range(12)])
    cfg = home / "nightshift.toml"
    cfg.write_text(f"""state_dir = "state"
[model]
path = "{tiny_model}"
name = "tiny"
[[sources]]
name = "inbox"
inbox = "inbox"
settle_seconds = 0
[plan]
prior_tokens_per_second = 2000
prior_overhead_seconds = 0
heldout_share = 0
[train]
backend = "hf"
batching = "padded"
lora_rank = 4
max_seq_length = 128
gradient_checkpointing = false
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # restored after the test (later tests find ./config from the checkout)
    return cfg


def test_relative_paths_in_a_config_file_are_relative_to_it(relative_config, monkeypatch):
    home = relative_config.parent
    s = load_settings(relative_config)
    assert s.state_dir == home / "state" and s.sources[0].inbox == home / "inbox"
    up = home / "up.toml"
    up.write_text(relative_config.read_text().replace('state_dir = "state"', 'state_dir = "../ns/./state"'))
    assert str(load_settings(up).state_dir) == str(home.resolve() / "state")  # shown without "..": the demo's
    monkeypatch.setenv("NIGHTSHIFT_STATE_DIR", "")  # empty: unset (it was "", the working directory)
    assert load_settings(relative_config).state_dir == home / "state"
    monkeypatch.setenv("NIGHTSHIFT_STATE_DIR", "mine")  # the environment keeps the shell's convention
    assert load_settings(relative_config).state_dir == Path("mine")


def test_no_read_only_command_creates_or_changes_a_state_directory(relative_config, capsys):
    home, elsewhere = relative_config.parent, Path.cwd()
    before = tree(home, elsewhere)
    for argv in READ_ONLY:
        cli(relative_config, argv)
        assert tree(home, elsewhere) == before, f"{argv} with no state directory"
        assert not (home / "state").exists() and not (elsewhere / "state").exists(), argv
    cli(relative_config, ["report"])  # the page goes to the working directory (it was <state_dir>/report.html)
    assert tree(home) == {k: v for k, v in before.items() if k.startswith(str(home))}
    assert not (home / "state").exists() and (elsewhere / "nightshift-report.html").is_file()
    capsys.readouterr()

    s = load_settings(relative_config)
    summary = run(s.night_config())  # a real state directory: a ledger, one version, `current`
    assert summary["outcome"] == "succeeded" and (home / "state" / "current").exists()
    # the default method is qlora, but nothing is quantised on a CPU: the version says lora (issue 42)
    manifest = json.loads((home / "state" / "current" / "manifest.json").read_text())
    assert summary["method"] == manifest["method"] == "lora"
    write_jsonl(home / "inbox" / "b.jsonl", [alpaca(i, " b") for i in range(4)])
    before = tree(home, elsewhere)
    for argv in READ_ONLY:
        cli(relative_config, argv)
        after = tree(home, elsewhere)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, f"{argv} changed the state directory: {changed}"
    cli(relative_config, ["report"])
    assert tree(home) == {k: v for k, v in before.items() if k.startswith(str(home))}
    out = capsys.readouterr().out
    assert "tiny-v0001" in out and json.dumps("succeeded") in out


def test_plan_reads_a_state_directory_this_user_may_not_write(relative_config, monkeypatch, capsys):
    """`plan` refused with "state_dir: ... is not writable" (exit 2) for an operator who is not the service's user,
    though it writes nothing. The kernel's answer to such a user stands in as os.access (the tests run as root)."""
    import os

    home, real_access = relative_config.parent, os.access

    def refuse(path, mode, *a, **k):
        if str(path).startswith(str(home)) and mode & os.W_OK:
            return False
        return real_access(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", refuse)
    before = tree(home)
    assert main(["--config", str(relative_config), "plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inbox"]["new_samples"] == 12
    assert tree(home) == before
    assert main(["--config", str(relative_config), "check-config"]) == 2  # a night would need to write
