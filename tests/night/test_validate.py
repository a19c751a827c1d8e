"""`nightshift validate FILE...`: the inbox's own reading, every would-be quarantined record with its
line and reason, a non-zero exit when there is one, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs.data.pull import Quarantine, pull
from jobs.night.validate import check_files
from jobs.store.ledger import Ledger
from jobs.store.readonly import open_read_only
from tests.conftest import REPO, alpaca, hang_bound, toml_config, write_jsonl


def test_check_files_reads_as_the_inbox_would(night_env, tokenizer, tmp_path):
    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0},
                        {"name": "qa", "inbox": tmp_path / "qa", "field_map": {"question": "instruction",
                                                                               "answer": "output"}}],
               train={"max_seq_length": 48})
    state = Path(cfg.state_dir)
    write_jsonl(inbox / "old.jsonl", [alpaca(i) for i in range(3)])
    led = Ledger(state / "ledger.sqlite")
    pull(cfg.sources[:1], led, tokenizer, run_id="r0", quarantine=Quarantine(state / "q.jsonl"), max_seq_length=48,
         overlong="reject")
    led.close()
    new = write_jsonl(tmp_path / "new.jsonl", [
        alpaca(1), alpaca(10), alpaca(10), "{not json", {"instruction": "no output"},
        {"instruction": "long " * 200, "output": "x"}, {"question": "q?", "answer": "a."}])
    qa = write_jsonl(tmp_path / "qa" / "mapped.jsonl", [{"question": "q?", "answer": "a."}])
    odd = write_jsonl(tmp_path / "data.txt", [alpaca(20)])
    ledger = open_read_only(state / "ledger.sqlite")
    checks = list(check_files([new, qa, odd, tmp_path / "missing.jsonl", inbox / "old.jsonl"], cfg, tokenizer,
                              ledger))
    ledger.close()
    c = checks[0]
    assert (c.source, c.records, c.would_train, c.known, c.repeated) == ("inbox", 7, 1, 1, 1)
    assert [(p.line, p.reason.value) for p in c.problems] == [
        (4, "invalid_json"), (5, "missing_field"), (6, "too_long"), (7, "missing_field")]
    assert "max_seq_length 48" in c.problems[2].detail and c.tokens > 0
    assert checks[1].source == "qa" and checks[1].would_train == 1 and not checks[1].problems  # its field map
    assert checks[2].problems[0].reason.value == "bad_file" and "unsupported file type" in checks[2].problems[0].detail
    assert checks[2].note and "patterns" in checks[2].note
    assert checks[3].problems[0].line is None and "no such file" in checks[3].problems[0].detail
    assert checks[4].already_ingested and (checks[4].known, checks[4].repeated, checks[4].would_train) == (2, 1, 0)


def test_validate_command_exit_status_and_nothing_written(tmp_path, tiny_model):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    good = write_jsonl(tmp_path / "good.jsonl", [alpaca(i) for i in range(5)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [alpaca(1), "{broken", {"text": ""}])
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def validate(*args):
        return subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "validate", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=hang_bound(180), env=env)

    r = validate(str(good), str(bad))
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"{bad}  (source 'inbox')" in r.stdout
    assert "  line 2: invalid_json: invalid JSON:" in r.stdout and "  line 3: empty_field: field 'text' is empty" \
        in r.stdout
    assert r.stdout.splitlines()[-1] == "2 file(s): 5 records would train, 2 would be quarantined " \
                                        "(empty_field 1, invalid_json 1)"
    assert not (tmp_path / "state").exists() and list(inbox.iterdir()) == []
    r = validate("--json", str(good))
    assert r.returncode == 0 and json.loads(r.stdout)[0]["would_train"] == 5
    r = validate("--source", "nope", str(good))
    assert r.returncode == 2 and "no [[sources]] is named 'nope'" in r.stderr
    # a mistyped name is a bad command line (exit 2, named), not "1 would be quarantined" (it said so, exit 1)
    r = validate(str(good), str(tmp_path / "typo.jsonl"), str(tmp_path))
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr.splitlines() == [f"nightshift validate: {tmp_path / 'typo.jsonl'}: no such file"]
    # what `validate inbox/*` names beside the data (processed/, a FIFO, a link out): each as the inbox takes it,
    # the rest checked (one such name refused the whole command line, a FIFO as "no such file")
    (inbox / "processed").mkdir()
    os.mkfifo(inbox / "pipe.jsonl")
    (inbox / "passwd.jsonl").symlink_to("/etc/passwd")
    r = validate(str(good), str(inbox / "processed"), str(inbox / "pipe.jsonl"), str(inbox / "passwd.jsonl"))
    assert r.returncode == 1 and "note: a directory: an inbox reads none" in r.stdout, r.stderr
    assert "the whole file: bad_file: not a regular file (a FIFO" in r.stdout
    assert "the whole file: outside_inbox: a symbolic link to /etc/passwd" in r.stdout and "root:" not in r.stdout
    assert r.stdout.splitlines()[-1] == "4 file(s): 5 records would train, 2 would be quarantined " \
                                        "(bad_file 1, outside_inbox 1)"
    # the inbox itself named (`nightshift validate inbox`): what is in it, processed/ and hidden names left out
    (inbox / ".partial.jsonl").write_text("{not json\n")
    r = validate(str(inbox))
    files = [line.split("  (source")[0] for line in r.stdout.splitlines() if "  (source" in line]
    assert files == sorted(str(p) for p in inbox.iterdir() if not p.name.startswith(".") and p.name != "processed")
    assert r.returncode == 1 and "note: a directory" not in r.stdout, r.stdout
    # a directory outside the inboxes (files to check before they are dropped in): what is in it, as for an inbox
    elsewhere = tmp_path / "incoming"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "a.jsonl").write_text(good.read_text())
    (elsewhere / "b.jsonl").write_text(bad.read_text())
    r = validate(str(elsewhere))
    files = [line.split("  (source")[0] for line in r.stdout.splitlines() if "  (source" in line]
    assert files == [str(elsewhere / "a.jsonl"), str(elsewhere / "b.jsonl")] and "note: a directory" not in r.stdout
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == "2 file(s): 5 records would train, 2 would be " \
                                                              "quarantined (empty_field 1, invalid_json 1)"
    r = validate(str(elsewhere / "sub"))  # an empty directory: said so (the check's own usage line leaked)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"0 file(s): {elsewhere / 'sub'} holds no files\n", "")


def test_check_files_takes_a_file_of_an_inbox_as_the_inbox_does(night_env, tokenizer, tmp_path):
    """In an inbox, a link is followed only inside it (as the pull does: it was read, /etc/passwd's lines shown as
    bad records), a FIFO or dangling link is refused without being opened, a name that is not UTF-8 is shown
    escaped (its FileCheck could not be written: the check failed with a traceback), and a name the inbox skips
    says so."""
    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0}])
    secret = write_jsonl(tmp_path / "elsewhere" / "secret.jsonl", [alpaca(1)])
    (inbox / "out.jsonl").symlink_to(secret)
    (inbox / "in.jsonl").symlink_to(write_jsonl(inbox / "real.jsonl", [alpaca(2)]))
    (inbox / "gone.jsonl").symlink_to(inbox / "nothing.jsonl")
    os.mkfifo(inbox / "pipe.jsonl")
    odd = Path(os.fsdecode(os.fsencode(inbox) + b"/caf\xe9.jsonl"))
    write_jsonl(odd, [alpaca(3)])
    hidden = write_jsonl(inbox / ".part.jsonl", [alpaca(4)])
    ledger = Ledger(tmp_path / "ledger.sqlite")
    names = ["out.jsonl", "in.jsonl", "gone.jsonl", "pipe.jsonl"]
    checks = list(check_files([*(inbox / n for n in names), odd, hidden, secret], cfg, tokenizer, ledger))
    got = {Path(c.file).name: ([(p.line, p.reason.value) for p in c.problems], c.would_train) for c in checks}
    assert got == {"out.jsonl": ([(None, "outside_inbox")], 0), "in.jsonl": ([], 1), "gone.jsonl":
                   ([(None, "unreadable")], 0), "pipe.jsonl": ([(None, "bad_file")], 0), "caf\\xe9.jsonl": ([], 1),
                   ".part.jsonl": ([], 1), "secret.jsonl": ([], 1)}  # named outside any inbox: read
    assert all(json.loads(c.model_dump_json()) for c in checks)
    assert "starts with '.'" in (checks[5].note or "")


def test_the_same_content_under_two_names_is_checked_once_as_the_inbox_reads_it(night_env, tokenizer, tmp_path):
    """The pull knows a file by its content: an empty `.parquet` beside an empty `.csv` (or a copy of a bad file) is
    not read again, so validate does not count its problems twice (it said 'bad_file' for the second)."""
    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0}])
    (inbox / "empty.csv").write_text("")
    (inbox / "empty.parquet").write_text("")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    first, second = check_files([inbox / "empty.csv", inbox / "empty.parquet"], cfg, tokenizer, ledger)
    assert not first.problems and not second.problems and second.records == 0
    assert second.note is not None and "same content as" in second.note and "empty.csv" in second.note


def test_a_file_that_cannot_be_read_now_is_not_called_quarantined(night_env, tokenizer, tmp_path, monkeypatch):
    """A file of the inbox this user may not read: the pull leaves it there and retries it each night, `plan` says
    "cannot be read now", but validate called it "bad_file: cannot read: PermissionError", "1 would be
    quarantined" (issue 42)."""
    import jobs.night.validate as validate_mod
    from daemon.validate_cli import render

    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0}])
    locked = write_jsonl(inbox / "locked.jsonl", [alpaca(1)])
    fine = write_jsonl(inbox / "fine.jsonl", [alpaca(2), "{broken"])
    real = validate_mod.sha256_file

    def denied(path):
        if Path(path).name == "locked.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(validate_mod, "sha256_file", denied)
    checks = list(check_files([locked, fine], cfg, tokenizer, Ledger(tmp_path / "ledger.sqlite")))
    assert [[p.reason.value for p in c.problems] for c in checks] == [["unreadable"], ["invalid_json"]]
    text = render(checks)
    assert "0 would be quarantined" in text.splitlines()[1] and "bad_file" not in text
    assert "cannot be read now: Permission denied" in text.splitlines()[2]
    assert text.splitlines()[-1] == ("2 file(s): 1 records would train, 1 would be quarantined (invalid_json 1), "
                                     "1 cannot be read now (a night retries them)")


def test_the_elements_of_a_json_array_on_one_line_are_told_apart(night_env, tokenizer, tmp_path):
    """A JSON array written on one line (what `json.dump` writes): every bad element was "line 1", which does not
    say which one; now validate says `line 1, record 3`, and the pull's quarantine entry and log keep the element."""
    from daemon.validate_cli import render

    inbox, make = night_env
    cfg = make(sources=[{"name": "inbox", "inbox": inbox, "settle_seconds": 0}])
    one_line = tmp_path / "export.json"
    one_line.write_text(json.dumps([alpaca(1), {"instruction": "no output"}, 42, alpaca(2), {"output": None}]))
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps([alpaca(3), {"instruction": "no output"}], indent=2))
    [c, p] = check_files([one_line, pretty], cfg, tokenizer, Ledger(tmp_path / "ledger.sqlite"))
    assert [(x.line, x.item, x.reason.value) for x in c.problems] == [
        (1, 2, "missing_field"), (1, 3, "wrong_type"), (1, 5, "missing_field")], c.problems
    assert [(x.line, x.item) for x in p.problems] == [(6, 2)]  # its own line, and still which element
    text = render([c, p])
    assert "  line 1, record 2: missing_field:" in text and "  line 1, record 3: wrong_type:" in text
    assert "  line 6, record 2: missing_field:" in text

    state = Path(cfg.state_dir)
    (inbox / "export.json").write_bytes(one_line.read_bytes())
    led = Ledger(state / "ledger.sqlite")
    try:
        pull(cfg.sources, led, tokenizer, run_id="r0", quarantine=Quarantine(state / "q.jsonl"), max_seq_length=256,
             overlong="reject")
    finally:
        led.close()
    q = [json.loads(line) for line in (state / "q.jsonl").read_text().splitlines()]
    assert [(e["line"], e["item"], e["reason"]) for e in q] == [
        (1, 2, "missing_field"), (1, 3, "wrong_type"), (1, 5, "missing_field")]
