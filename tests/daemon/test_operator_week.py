"""An operator's week on the demo config (issue 42): what broke between nights, each in-process and fast."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from daemon import cli
from daemon.supervisor import ChildOutcome
from jobs.contract import ExitCode, HotswapOutcome, Outcome, RunSummary
from tests.conftest import toml_config


def stand_in_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"  # never loaded: the child is a stand-in; `once` checks that it is there
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


def config(tmp_path: Path, more: str = "") -> Path:
    cfg, _ = toml_config(tmp_path, stand_in_model(tmp_path),
                         more="[window]\nsave_margin_minutes = 1\n[daemon]\nmin_free_disk_gb = 0\n" + more)
    return cfg


def once_returning(monkeypatch: pytest.MonkeyPatch, summary: RunSummary | None, rc: int = 0) -> None:
    monkeypatch.setattr(cli, "run_child", lambda *a, **kw: ChildOutcome(rc, summary, ["last line"]))


def test_a_night_published_but_not_taken_by_a_server_exits_4_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    """The README's exit status 4 ("published, but at least one inference server did not take it") was never
    returned by `once`: a night whose vLLM was down ended 0 and its summary did not mention the hot-swap."""
    cfg = config(tmp_path)
    down = HotswapOutcome(target="vllm-local", kind="vllm", ok=False, attempts=3,
                          error="GET http://127.0.0.1:18999/v1/models: Connection refused")
    night = RunSummary(night="manual-x", outcome=Outcome.succeeded, version=2, version_name="tiny-v0002",
                       promoted=True, hotswap=[down])
    once_returning(monkeypatch, night)
    assert cli.main(["--config", str(cfg), "once", "--until", "+30min"]) == ExitCode.HOTSWAP_FAILED
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if line.startswith("hot-swap"))
    assert "vllm-local: GET http://127.0.0.1:18999/v1/models: Connection refused" in row
    assert "`nightshift hotswap` re-sends it" in err and "vllm-local" in err
    ok = night.model_copy(update={"hotswap": [down.model_copy(update={"ok": True, "error": None})]})
    once_returning(monkeypatch, ok)
    assert cli.main(["--config", str(cfg), "once", "--until", "+30min"]) == ExitCode.OK
    assert "vllm-local ok" in capsys.readouterr().out
    several = RunSummary(night="manual-x", outcome=Outcome.succeeded,
                         adapters=[night.model_copy(update={"adapter": "support"})])
    once_returning(monkeypatch, several)
    assert cli.main(["--config", str(cfg), "once", "--until", "+30min"]) == ExitCode.HOTSWAP_FAILED
    assert "adapter support: vllm-local" in capsys.readouterr().err


@pytest.mark.parametrize("until", ["+3min", "+2h", "+90s", "+1.5h", "12:30", "23:59:59"])
def test_until_takes_a_time_of_day_or_a_span_from_now(until):
    now = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
    end = cli.parse_until(until, 0, now) - now.timestamp()
    assert 0 < end <= 86400
    assert cli.parse_until("+3min", 0, now) == now.timestamp() + 180


@pytest.mark.parametrize("until", ["+3", "+3 days", "+-5min", "+0min", "25:00", "noon", "+infh"])
def test_a_malformed_until_is_a_bad_command_line(tmp_path, until, capsys):
    """It ended with status 1 (the one of a failed night), after taking the night lock; the README's 2 is for a bad
    command line, and argparse now says it with the usage."""
    cfg = config(tmp_path)
    for command in ("once", "plan"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--config", str(cfg), command, "--until", until])
        assert e.value.code == ExitCode.USAGE
        assert "+N with s, min or h" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_a_sentence_after_a_url_keeps_the_endpoint_name_readable():
    """Every hot-swap error read `GET http://127.0.0.1:18999/v1/*** Connection refused`: the colon that ends the
    URL was taken into its last segment, which then was no endpoint name and was masked."""
    from jobs.contract.redact import redact_text

    assert redact_text("GET http://127.0.0.1:8000/v1/models: Connection refused") == (
        "GET http://127.0.0.1:8000/v1/models: Connection refused")
    assert redact_text("POST https://hooks.example/T0/B0/secret: HTTP 500.") == (
        "POST https://hooks.example/***/***/***: HTTP 500.")
    assert redact_text("(see http://h:1/v1/load_lora_adapter?token=abc).") == (
        "(see http://h:1/v1/load_lora_adapter?token=***).")


def test_plan_says_why_the_night_would_be_refused(tmp_path, monkeypatch, capsys):
    """With the adapter in service altered, `plan` printed "nightshift plan: failed (exit status 1)" and, piped,
    the child's JSON log lines: the reason was only inside a log line's "error" field."""
    cfg = config(tmp_path)
    why = "damaged state: the version in service tiny-v0001 fails its integrity check (...). Restore its files"
    once_returning(monkeypatch, RunSummary(night="manual-x", outcome=Outcome.failed, error=why), rc=1)
    assert cli.main(["--config", str(cfg), "plan", "--until", "+30min"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"nightshift plan: refused: {why}"]


def test_once_failing_after_its_version_was_promoted_says_that_version_is_in_service(tmp_path, monkeypatch, capsys):
    """A disk that filled after the publish: `once` printed "outcome failed" and exit 1, not that the new version
    was in service (the ledger closed the night as succeeded)."""
    import time

    from jobs.store.ledger import Ledger
    from tests.store.test_adapters import craft

    cfg = config(tmp_path)
    cfg.write_text(cfg.read_text().replace("[model]\n", '[model]\nbuild = "tiny-llama"\n'))
    (tmp_path / "model" / "config.json").unlink()  # craft's versions name no real base to compare with
    night = f"manual-{dt.datetime.now().astimezone().date().isoformat()}"
    craft(tmp_path / "state", 1, run_id=f"{night}-abc")
    Ledger(tmp_path / "state" / "ledger.sqlite").start_run(f"{night}-abc", night, time.time() + 3600)
    failed = RunSummary(night=night, run_id=f"{night}-abc", outcome=Outcome.failed, version=1,
                        version_name="tiny-v0001", error="OperationalError: database or disk is full")
    once_returning(monkeypatch, failed, rc=1)
    assert cli.main(["--config", str(cfg), "once", "--until", "+30min"]) == 1
    err = capsys.readouterr().err
    assert "failed: OperationalError: database or disk is full" in err
    assert "tiny-v0001 was promoted before that and is in service" in err


def test_a_full_disk_is_named_with_what_to_do_and_doctor_reports_it(tmp_path, capsys):
    """On a 3 MB tmpfs filled to the brim, `once` ended "the ledger cannot be used: database or disk is full
    (`nightshift doctor` explains)" and doctor said "no problems found"."""
    import errno
    import sqlite3

    from daemon.preflight import one_line

    def fill() -> int:  # SQLite's own SQLITE_FULL, as a full disk gives it
        db = sqlite3.connect(tmp_path / "small.sqlite")
        db.execute("PRAGMA max_page_count=2")
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (?)", ("x" * 100_000,))
        return 0

    def no_space() -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state" / "adapters"))

    for fn in (fill, no_space):
        assert one_line("once", fn) == ExitCode.FAILED
        err = capsys.readouterr().err
        assert "free some space on that disk" in err and len(err.strip().splitlines()) == 1, err
        assert "cannot be used" not in err
    cfg = config(tmp_path).read_text().replace("min_free_disk_gb = 0", "min_free_disk_gb = 1e12")
    (tmp_path / "full.toml").write_text(cfg)
    assert cli.main(["--config", str(tmp_path / "full.toml"), "doctor"]) == ExitCode.FAILED
    out = capsys.readouterr().out
    assert "PROBLEM disk: only" in out and "min_free_disk_gb = 1e+12 GB" in out and "fix: free some space" in out
    assert not (tmp_path / "state").exists()


ADAPTERS = '[[adapters]]\nname = "support"\nsources = ["inbox"]\n'


def test_a_config_edit_that_would_restart_the_lineage_is_a_problem_before_any_night(tmp_path, capsys):
    """check-config said OK and the next night trained from the base model: [[adapters]] added to a config whose
    state holds one adapter's versions, or taken out again (problems); [model] path pointed at other weights and
    another LoRA rank are said, as notes (a night goes on: re-saved weights read as other weights)."""
    from tests.store.test_adapters import craft

    state = tmp_path / "state"
    craft(state, 1)  # the one adapter of a config without [[adapters]], in service
    cfg = config(tmp_path, ADAPTERS)
    assert cli.main(["--config", str(cfg), "check-config"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "holds the versions of a config without [[adapters]]" in err and "tiny-v0001 in service" in err
    assert cli.main(["--config", str(cfg), "plan"]) == ExitCode.USAGE  # `once` and `run` check the same
    assert "would start again from the base model" in capsys.readouterr().err
    assert cli.main(["--config", str(cfg), "doctor"]) == ExitCode.FAILED
    assert "PROBLEM config: [[adapters]]: state_dir" in capsys.readouterr().out

    other = tmp_path / "other"
    craft(other / "state" / "by-adapter" / "support", 1)
    cfg = config(other)  # [[adapters]] taken out again
    assert cli.main(["--config", str(cfg), "check-config"]) == ExitCode.USAGE
    assert "holds the versions of adapters support" in capsys.readouterr().err

    # craft's manifest names base fingerprint "f"; the stand-in model has another
    cfg = config(tmp_path)
    assert cli.main(["--config", str(cfg), "check-config"]) == ExitCode.OK  # said, not refused: a night goes on
    err = capsys.readouterr().err
    assert "note: [model] path: " in err and "not the base model the adapter in service tiny-v0001 was trained on" \
        in err
    (tmp_path / "model" / "config.json").unlink()  # built at the first night (the demo): nothing to compare yet
    text = cfg.read_text().replace("[model]\n", '[model]\nbuild = "tiny-llama"\n')
    cfg.write_text(text)
    assert cli.main(["--config", str(cfg), "check-config"]) == ExitCode.OK
    # lora_rank 4 -> 8: a night went on at rank 4 (the parent's shape) and its manifest said 8
    cfg.write_text(text.replace("lora_rank = 4", "lora_rank = 8"))
    assert cli.main(["--config", str(cfg), "check-config"]) == ExitCode.OK
    assert "note: [train] lora_rank 8, lora_alpha 16: the adapter in service tiny-v0001 has rank 4, and" in (
        capsys.readouterr().err)
    assert cli.main(["--config", str(cfg), "doctor"]) == ExitCode.OK  # a note, not a problem
    assert "lora_rank 8" in capsys.readouterr().out


def test_a_version_gone_from_disk_is_shown_missing_and_a_send_that_failed_is_not_called_sent(tmp_path, capsys):
    """A version deleted by hand was listed as any other, `show` called it "files deleted (pruned)" and `promote`
    said "it is promoted and not on disk"; `hotswap` to a server that was down printed "sent tiny-v0001"."""
    import json
    import shutil

    from tests.fixtures.lora_servers import Fake
    from tests.store.test_adapters import cli, craft, settings

    state = tmp_path / "state"
    craft(state, 1)
    v2 = craft(state, 2)
    s = settings(state)
    assert cli(s, "adapters", "promote", "1") == 0
    capsys.readouterr()
    v2.chmod(0o750)
    shutil.rmtree(v2)
    assert cli(s, "adapters", "list") == 0
    out = capsys.readouterr().out
    assert "promoted, MISSING" in next(ln for ln in out.splitlines() if "tiny-v0002" in ln)
    assert "not pruned): restore it from a backup" in out
    assert cli(s, "adapters", "list", "--json") == 0
    assert [r["missing"] for r in json.loads(capsys.readouterr().out)] == [False, True]
    assert cli(s, "adapters", "show", "2") == 0
    assert f"files MISSING from {v2} (not pruned)" in capsys.readouterr().out
    assert cli(s, "adapters", "promote", "2") == 1
    assert f"its directory {v2} is missing (it was not pruned): restore it" in capsys.readouterr().err
    assert cli(s, "adapters", "show", "7") == 1
    assert "`nightshift adapters list` lists them" in capsys.readouterr().err

    down = Fake("fail", status=500)
    try:
        s = settings(state, {"kind": "vllm", "name": "down", "base_url": down.url, "retries": 0})
        assert cli(s, "hotswap") == 4
        out, err = capsys.readouterr()
        assert "tried to send tiny-v0001; integrity verified" in out.splitlines() and "sent tiny-v0001" not in out
        assert "tiny-v0001 stays in service here: run `nightshift hotswap` again once the server is up" in err
        craft(state, 3)
        assert cli(s, "adapters", "rollback") == 4
        assert "the move stands: tiny-v0001 is in service here" in capsys.readouterr().err
    finally:
        down.close()


def test_a_stopped_once_says_its_version_is_not_published_and_how_it_resumes(tmp_path, monkeypatch, capsys):
    """SIGTERM mid-night: the summary read "version tiny-v0003" (a number only reserved) and nothing said what
    becomes of the night."""
    import time

    from jobs.store.ledger import Ledger

    cfg = config(tmp_path)
    night = f"manual-{dt.datetime.now().astimezone().date().isoformat()}"
    Ledger(tmp_path / "state" / "ledger.sqlite").start_run(f"{night}-abc", night, time.time() + 3600)
    stopped = RunSummary(night=night, run_id=f"{night}-abc", outcome=Outcome.interrupted, version=3,
                         version_name="tiny-v0003", stopped="signal")
    once_returning(monkeypatch, stopped, rc=3)
    assert cli.main(["--config", str(cfg), "once", "--until", "+30min"]) == ExitCode.INTERRUPTED
    out, err = capsys.readouterr()
    assert "tiny-v0003 (not published yet: the night resumes from its checkpoint)" in out
    assert f"nightshift once: stopped; run {night}-abc of night {night} is open (attempt 1): a start before" in err
    assert "resumes it from its last checkpoint" in err


def test_status_says_which_inference_server_did_not_take_the_version_in_service(tmp_path, capsys):
    """After a night whose vLLM was down, `status` showed the version in service and nothing about the servers:
    the operator learnt it from the journal only."""
    import json

    from jobs.store.ledger import Ledger
    from tests.store.test_adapters import craft

    state = tmp_path / "state"
    craft(state, 1)
    ledger = Ledger(state / "ledger.sqlite")
    for target, ok in (("vllm-local", False), ("gone", False), ("sglang", True)):
        ledger.record_hotswap(1, HotswapOutcome(target=target, kind="vllm", ok=ok, attempts=3,
                                                error=None if ok else "GET http://127.0.0.1:1/v1/models: refused"),
                              trigger="night")
    ledger.close()
    targets = "".join(f'[[hotswap.targets]]\nkind = "{k}"\nname = "{n}"\nbase_url = "http://127.0.0.1:1"\n'
                      for k, n in (("vllm", "vllm-local"), ("sglang", "sglang")))
    cfg = config(tmp_path, targets)
    cfg.write_text(cfg.read_text().replace("[model]\n", '[model]\nbuild = "tiny-llama"\n'))
    (tmp_path / "model" / "config.json").unlink()  # craft's versions name no real base to compare with
    assert cli.main(["--config", str(cfg), "status"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("inference servers"))
    assert "vllm-local did NOT take it (" in line and "/v1/models: refused" in line and "sglang ok" in line
    assert "gone" not in line  # no longer configured: no longer asked
    assert cli.main(["--config", str(cfg), "status", "--json"]) == 0
    sends = json.loads(capsys.readouterr().out)["in_service"]["hotswap"]
    assert {k: v["ok"] for k, v in sends.items()} == {"vllm-local": False, "sglang": True}
    from daemon.status import _adapters  # [[adapters]]: each adapter's row says it
    info = {"in_service": {"name": "support-v0001", "hotswap": sends}, "runs": [], "backlog": {"samples": 0,
                                                                                               "tokens": 0}}
    assert "not taken by vllm-local (`nightshift hotswap --adapter support`)" in _adapters({"support": info})


def test_a_server_still_down_when_the_service_starts_shows_in_the_hot_swap_series(tmp_path):
    """The service re-sends at its start what a server missed; when that failed too, the hot-swap series (and the
    alert on them) read 0 failures: a restart hid a server that had been down for nights."""
    from prometheus_client import CollectorRegistry

    from daemon.service import Service
    from daemon.settings import load_settings
    from jobs.store.ledger import Ledger
    from tests.fixtures.lora_servers import Fake
    from tests.store.test_adapters import craft

    state = tmp_path / "state"
    craft(state, 1)
    Ledger(state / "ledger.sqlite").record_hotswap(1, HotswapOutcome(target="v", kind="vllm", ok=False,
                                                                     error="refused"), trigger="night")
    down = Fake("fail", status=500)
    try:
        cfg = config(tmp_path, f'[[hotswap.targets]]\nkind = "vllm"\nname = "v"\nbase_url = "{down.url}"\n'
                               "retries = 0\n")
        cfg.write_text(cfg.read_text().replace("[model]\n", '[model]\nbuild = "tiny-llama"\n'))
        (tmp_path / "model" / "config.json").unlink()  # craft's versions name no real base to compare with
        registry = CollectorRegistry()
        svc = Service(load_settings(cfg), registry=registry)
        svc._resend_unheard()
    finally:
        down.close()
    labels = {"kind": "vllm", "outcome": "failure"}
    assert registry.get_sample_value("nightshift_hotswap_attempts_total", labels) == 1
    assert registry.get_sample_value("nightshift_hotswap_consecutive_failures", {"kind": "vllm"}) == 1


def test_plan_refuses_an_until_inside_the_save_margin_as_once_does(tmp_path, monkeypatch, capsys):
    """`once --until +30s` said "no time to train" (status 2); `plan --until +30s` printed an empty plan, 0."""
    cfg = config(tmp_path)
    once_returning(monkeypatch, None)
    for command in ("plan", "once"):
        assert cli.main(["--config", str(cfg), command, "--until", "+30s"]) == ExitCode.USAGE
        assert "save_margin_minutes (1), the time kept to save before the end: no time to train" in (
            capsys.readouterr().err)


def test_the_report_names_a_server_that_did_not_take_a_nights_version():
    """The report showed such a night as a plain "succeeded" row: the failed hot-swap was nowhere on the page."""
    from daemon.report_data import night_row
    from daemon.report_html import table

    run = {"night": "2026-11-28", "id": "r1", "status": "succeeded", "started_at": 1.0, "ended_at": 9.0,
           "error": None}
    summary = {"version_name": "tiny-v0002", "promoted": True,
               "hotswap": [{"target": "vllm-local", "kind": "vllm", "ok": False, "error": "refused"},
                           {"target": "sglang", "kind": "sglang", "ok": True}]}
    row = night_row(run, summary, {})
    assert row.hotswap_failed == ["vllm-local"]
    page = table([row])
    assert "hot-swap: vllm-local did not take it" in page and "sglang" not in page


def test_status_says_when_the_next_window_will_not_run_because_its_night_is_done(tmp_path, capsys):
    """The window moved to later the same day after that day's night ran: the service rightly does not run it
    again (one night per date), but `status` named it as the next window."""
    import time

    from daemon.settings import load_settings
    from daemon.status import collect, render
    from jobs.store.ledger import Ledger

    cfg = config(tmp_path).read_text().replace("[window]\n", '[window]\nstart = "13:00"\nend = "18:00"\n'
                                                             'timezone = "UTC"\n')
    (tmp_path / "n.toml").write_text(cfg)
    s = load_settings(tmp_path / "n.toml")
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite")
    ledger.start_run("r1", "2026-11-28", time.time())
    ledger.db.execute("UPDATE runs SET status='succeeded', ended_at=started_at WHERE id='r1'")
    ledger.close()
    now = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)
    info = collect(s, now)
    assert info["next_window_start"].startswith("2026-11-29T13:00")
    assert info["skipped_window"] == {"start": "2026-11-28T13:00+00:00", "night": "2026-11-28"}
    assert "2026-11-28T13:00+00:00 is not run: its night 2026-11-28 is done already" in render(info)
    info = collect(s, dt.datetime(2026, 11, 28, 14, 0, tzinfo=dt.UTC))
    assert "(open now; its night is done)" in render(info) and "skipped_window" not in info


@pytest.mark.parametrize("argv", [("hotswap",), ("adapters", "rollback"), ("adapters", "promote", "1"),
                                  ("adapters", "pin", "1"), ("adapters", "prune")])
def test_a_registry_command_before_any_night_says_so_and_creates_nothing(tmp_path, capsys, argv):
    """`hotswap` on a fresh install was refused ("no version is in service") after creating the state directory,
    its ledger and its lock."""
    cfg = config(tmp_path)
    assert cli.main(["--config", str(cfg), *argv]) == 1
    assert "nothing is published yet in" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_a_diff_shows_times_as_times():
    """`adapters diff` printed `created_at 1795868801.0865324 -> 1795868844.7975001  (+43.71, +0.0%)`."""
    import time

    from daemon.adapters_view import diff_lines

    a, b = 1795868801.08, 1795868844.79
    text = diff_lines("v1", "v2", [("created_at", a, b)])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a))
    assert f"created_at  {when} -> " in text and "(+44 s)" in text and "%" not in text
