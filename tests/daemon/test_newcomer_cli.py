"""Small things a newcomer met (issue 42): "did you mean" for a misspelt key, quiet on a closed pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.settings import ConfigError, load_settings
from tests.conftest import hang_bound

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("toml", "said"), [
    ('[train]\nlora_rnak = 8\n', "[train] lora_rnak: unknown key (did you mean 'lora_rank'?)"),
    ('stat_dir = "s"\n', "stat_dir: unknown key (did you mean 'state_dir'?)"),
    ('[[sources]]\nname = "a"\ninbx = "i"\n', "[[sources]] #1 inbx: unknown key (did you mean 'inbox'?)"),
    # a table in an array under a section, a member of a tagged union: no pydantic tag in the name (was
    # "[hotswap] targets.0.vllm.nmae: unknown key", no guess)
    ('[[hotswap.targets]]\nkind = "vllm"\nname = "v"\nbase_url = "http://127.0.0.1:8000"\nnmae = "x"\n',
     "[[hotswap.targets]] #1 nmae: unknown key (did you mean 'name'?)"),
    ('[[hotswap.targets]]\nkind = "vlm"\nname = "v"\n',
     "[[hotswap.targets]] #1 kind: 'vlm' is not a kind (one of 'command', 'sglang', 'vllm', 'webhook'); "
     "did you mean 'vllm'?"),
    ('[[hotswap.targets]]\nknd = "vllm"\n',
     "[[hotswap.targets]] #1 kind: required key is missing (one of 'command', 'sglang', 'vllm', 'webhook')"),
])
def test_a_misspelt_key_gets_a_did_you_mean(tmp_path, toml, said):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml + f'[model]\npath = "{tmp_path}"\n' if toml.startswith("stat") else
                   f'[model]\npath = "{tmp_path}"\n' + toml)
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert said in e.value.problems


def test_each_problem_of_several_adapters_is_a_problem_of_its_own(tmp_path):
    """The [[adapters]] check reported two problems as "1 problem(s)", the second glued to the first."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path}"\n[[adapters]]\nname = "a"\nsources = ["x"]\n'
                   '[[adapters]]\nname = "b"\nsources = ["y"]\n[adapters.train]\nlora_rnak = 4\n')
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert "[[adapters]] #2 train.lora_rnak: unknown key (did you mean 'lora_rank'?)" in e.value.problems
    assert all("\n" not in p for p in e.value.problems)
    assert str(e.value).count("\n  - ") == len(e.value.problems) == int(str(e.value).split(": ")[1].split()[0])


def test_an_empty_path_is_named_not_read_as_the_working_directory(tmp_path, monkeypatch):
    """`state_dir = ""` passed check-config and put the ledger in whatever directory a command ran from."""
    (tmp_path / "inbox").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text('state_dir = ""\n[model]\npath = " "\nbuild = "tiny-llama"\n[[sources]]\nname = "a"\n'
                   'inbox = "inbox"\n[eval]\nregression_set = ""\n')
    monkeypatch.chdir(tmp_path / "inbox")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert sorted(p.split(":")[0] for p in e.value.problems) == ["[eval] regression_set", "[model] path", "state_dir"]
    assert all(": empty (a path is needed" in p for p in e.value.problems), e.value.problems


def test_a_config_saved_with_a_byte_order_mark_and_crlf_reads_as_any_other(tmp_path):
    """Notepad's UTF-8 starts with a BOM: it was "not valid TOML: Invalid statement (at line 1, column 1)"."""
    (tmp_path / "inbox").mkdir()
    text = 'state_dir = "state"\n[model]\npath = "m"\nbuild = "tiny-llama"\n[[sources]]\nname = "a"\ninbox = "inbox"\n'
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    s = load_settings(cfg)
    assert (s.state_dir, s.sources[0].inbox) == (tmp_path / "state", tmp_path / "inbox")


def test_a_huge_value_is_quoted_short_and_a_path_the_kernel_refuses_is_a_problem_not_a_traceback(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{"s" * 100_000}"\n[model]\npath = "{tmp_path}"\n'
                   f'[train]\nlora_rank = "{"x" * 10**6}"\n')
    with pytest.raises(ConfigError) as e:  # was OSError: [Errno 36] File name too long, and a 1 MB message
        load_settings(cfg)
    assert len(str(e.value)) < 2000, len(str(e.value))
    said = {p.split(":")[0]: p for p in e.value.problems}
    assert "(1,000,002 characters)" in said["[train] lora_rank"]
    assert said["state_dir"].endswith(" characters) cannot be used: File name too long")


def test_a_directory_given_as_the_config_is_named_so(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path)
    assert e.value.problems == ["a directory, not a config file: give the TOML file in it"]


def test_a_key_like_no_other_gets_no_guess(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path}"\n[train]\nzzqx = 1\n')
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert "[train] zzqx: unknown key" in e.value.problems


def test_status_into_a_closed_pipe_is_quiet(tmp_path):
    """`nightshift status | head -1`: head exits after one line; nightshift must not print "Broken pipe"."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n[model]\npath = "{tmp_path}"\nbuild = "tiny-llama"\n')
    r = subprocess.run(f"{sys.executable} -m daemon --config {cfg} status | head -1", shell=True, cwd=REPO,
                       capture_output=True, text=True, timeout=hang_bound(600))
    assert r.stdout.startswith("config") and r.stderr == "", r.stderr


def test_adapters_show_and_diff_summarise_and_keep_the_whole_json_behind_a_flag():
    from daemon.adapters_view import diff_lines, show_lines

    manifest = {"night": "2026-11-21", "data": {"samples": 342}, "losses": {"heldout_after": 3.1},
                "gate": {"passed": False, "checks": [{"name": "heldout.loss", "passed": False}]},
                "config": {"train": {"lora_rank": 8}}, "files": {f"f{i}": "h" for i in range(900)}}
    text = show_lines("tiny-v0002", "kept", manifest)
    assert len(text.splitlines()) < 15 and "342" in text and "failed: heldout.loss" in text and "--json" in text
    rows = [(f"losses.curve.{i}.loss", 1.0 + i, 2.0 + i) for i in range(176)] + [("data.samples", 300, 342)]
    text = diff_lines("tiny-v0001", "tiny-v0002", rows)
    assert len(text.splitlines()) == 3 and "176 entries differ" in text and "300 -> 342" in text
    # every set's figures under every model, the per-night slices, the phases' seconds, the plan's detail: only the
    # version's own answers (each set's exact match and reply tokens after) have lines of their own, the rest one
    # line each (two nights' diff printed 92 lines, 45 of them these; then still 65, with each set's before,
    # reference and base loss and exact match, and 3.4344150571894825 for a loss)
    sets = [f"{d}_{m}" for d in ("heldout", "regression", "canary", "retention", "tonight")
            for m in ("before", "after", "reference", "base")]
    rows = [(f"metrics.{s}.{f}", 0.5, 0.6) for s in sets for f in ("exact_match", "token_accuracy", "loss", "n")]
    rows += [(f"regression_slices.2026-11-{d}/inbox.after.exact_match", 0.5, 0.6) for d in range(10, 28)]
    rows += [(f"phase_seconds.{p}", 0.1, 0.2) for p in ("pull", "plan", "load", "train", "publish")]
    rows += [("plan.tokens_per_second", 8789.091113997425, 7645.607315180137), ("plan.train_tokens", 8196, 135066),
             ("losses.heldout_after", 3.4344150571894825, 2.487746770502655), ("version", 2, 3)]
    text = diff_lines("tiny-v0001", "tiny-v0002", rows)
    assert "metrics.heldout_after.exact_match" in text and "metrics.tonight_after.token_accuracy" in text
    assert "metrics.tonight_base" not in text and "metrics.heldout_after.loss" not in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "(other figures)" in lines["metrics"] and lines["metrics"].endswith("70 entries differ")
    assert lines["regression_slices"].endswith("18 entries differ")
    assert lines["phase_seconds"].endswith("5 entries differ") and lines["plan"].endswith("2 entries differ")
    assert lines["losses.heldout_after"].endswith("3.4344 -> 2.4877  (-0.9467, -27.6%)")
    assert lines["version"].endswith("2 -> 3  (+1)")  # a number, not a size: no +50 %
    assert len(text.splitlines()) == 1 + 2 * 5 + 1 + 1 + 1 + 1 + 1 + 1


def test_plan_asks_the_child_for_the_night_and_deadline_once_will_use(tmp_path, monkeypatch):
    """The replay draw is seeded by the night's name and the plan is sized by the training deadline: `plan` used
    "plan" and the window's very end, so `once` a minute later replayed 45 where the plan said 52 (issue 42)."""
    import datetime as dt

    from daemon import cli
    from tests.conftest import toml_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg, _ = toml_config(tmp_path, model, more="[window]\nsave_margin_minutes = 3\n")
    asked: list[tuple[str, float]] = []

    class Out:
        summary, tail = None, []

        def describe_exit(self) -> str:
            return "stand-in"

    def run_child(s, *, night, deadline, plan_only, **kw):
        asked.append((night, deadline))
        return Out()

    monkeypatch.setattr(cli, "run_child", run_child)
    until = (dt.datetime.now() + dt.timedelta(minutes=30)).replace(microsecond=0)
    for cmd in ("plan", "once"):
        cli.main(["--config", str(cfg), cmd, "--until", until.strftime("%H:%M:%S")])
    (plan_night, plan_deadline), (once_night, once_deadline) = asked
    assert plan_night == once_night and plan_night.startswith("manual-")
    assert plan_deadline == once_deadline == until.timestamp() - 180


def test_an_unreadable_inbox_file_is_shown_by_the_plan_and_not_called_quarantined(tmp_path, tokenizer,
                                                                                   monkeypatch):
    """The pull leaves an unreadable file in place and retries it; the plan did not show it and `once` called
    it quarantined (issue 42)."""
    from daemon import report
    from jobs.contract import Outcome, RunSummary
    from jobs.data import preview as preview_mod
    from jobs.data.sources import SourceConfig
    from jobs.store.readonly import open_read_only
    from tests.conftest import alpaca, write_jsonl

    inbox = tmp_path / "inbox"
    write_jsonl(inbox / "a.jsonl", [alpaca(1)])
    write_jsonl(inbox / "b.jsonl", [alpaca(2), "{broken"])

    def refuse(f, allowed):
        if f.display.endswith("a.jsonl"):
            raise PermissionError(13, "Permission denied")
        return real(f, allowed)

    real = preview_mod.open_inbox_file
    monkeypatch.setattr(preview_mod, "open_inbox_file", refuse)
    led = open_read_only(tmp_path / "state" / "ledger.sqlite")
    res = preview_mod.preview([SourceConfig(name="in", inbox=inbox, settle_seconds=0)], led, tokenizer,
                              max_seq_length=128, overlong="reject")
    assert res.quarantined == {"unreadable": 1, "invalid_json": 1} and res.ingested == {"in": 1}
    table = report.inbox_table({"files": 1, "new_samples": 1, "duplicates": 0, "would_quarantine": res.quarantined})
    [would] = [x for x in table.splitlines() if x.startswith("would be quarantined")]
    assert "invalid_json 1" in would and "unreadable" not in would and "cannot be read now" in table
    s = RunSummary(night="n", outcome=Outcome.succeeded, quarantined={"unreadable": 1, "invalid_json": 1})
    text = report.summary_table(s)
    [line] = [x for x in text.splitlines() if x.startswith("quarantined")]
    assert "unreadable" not in line and "invalid_json 1" in line and "tried again at the next pull" in text


def test_the_report_shows_a_night_interrupted_and_resumed(tmp_path):
    """Not one plain "succeeded" row (issue 42): the attempts, the interruptions and the crashes."""
    from daemon.report_data import collect
    from daemon.report_html import outcome_text
    from jobs.store.ledger import Ledger

    led = Ledger(tmp_path / "ledger.sqlite")
    led.start_run("r1", "2026-11-21", 2e9)
    led.add_event("interrupted", run_id="r1", detail={"next_batch": 3, "of": 9})
    led.resume_run("r1", 2e9)
    led.finish_run("r1", "succeeded")
    led.start_run("r2", "2026-11-22", 2e9)
    led.finish_run("r2", "succeeded")
    night1, night2 = collect(tmp_path, 14, ledger=led).nights
    led.close()
    assert (night1.attempts, night1.interruptions, night1.failed_attempts) == (2, 1, 0)
    assert outcome_text(night1) == "succeeded after 2 attempts (1 interrupted, resumed)"
    assert outcome_text(night2) == "succeeded"


@pytest.mark.parametrize(("argv", "said"), [
    (["onse"], "did you mean 'once'?"),
    (["adapters", "lst"], "did you mean 'list'?"),
    (["check-confg"], "did you mean 'check-config'?"),
])
def test_a_misspelt_command_gets_a_did_you_mean(argv, said, capsys):
    from daemon.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and "choose from" in err, err


def test_a_command_like_no_other_gets_no_guess_only_the_choices(capsys):
    from daemon.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["xyzzy"])
    err = capsys.readouterr().err
    assert "did you mean" not in err and "'once'" in err, err


def test_a_misspelt_variable_is_named_as_the_variable(tmp_path, monkeypatch):
    """`NIGHTSHIFT_TRAIN__LORA_RNAK=4` was reported as "[train] lora_rnak: unknown key", a key the config file does
    not have: the operator searched the file for it."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\npath = "{tmp_path}"\n[train]\nlora_rank = 8\n')
    monkeypatch.setenv("NIGHTSHIFT_TRAIN__LORA_RNAK", "4")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    said = "NIGHTSHIFT_TRAIN__LORA_RNAK: unknown key (did you mean NIGHTSHIFT_TRAIN__LORA_RANK?)"
    assert said in e.value.problems and not any("lora_rnak" in p for p in e.value.problems)
