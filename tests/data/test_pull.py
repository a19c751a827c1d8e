import json
import os
import shutil

import datasets
import pytest

from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, write_jsonl


@pytest.fixture()
def env(tmp_path, tokenizer):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    qfile = tmp_path / "quarantine.jsonl"

    def do_pull(run_id="r1", **src):
        cfg = SourceConfig(name="s", inbox=inbox, settle_seconds=0, **src)
        return pull([cfg], ledger, tokenizer, run_id=run_id, quarantine=Quarantine(qfile), max_seq_length=64,
                    overlong="reject")

    def quarantined():
        return [json.loads(x) for x in qfile.read_text().splitlines()] if qfile.exists() else []

    return inbox, ledger, do_pull, quarantined


def test_jsonl_bad_lines_are_quarantined_with_reason_and_the_rest_ingested(env):
    inbox, ledger, do_pull, quarantined = env
    p = inbox / "a.jsonl"
    lines = [json.dumps(alpaca(1)), "{not json", json.dumps({"instruction": "x"}),
             json.dumps({"instruction": "", "output": "y"}), json.dumps({"text": "word " * 100}),
             json.dumps(alpaca(2))]
    p.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xff\xfe bad"}\n')
    res = do_pull()
    assert res.files == 1 and res.ingested["s"] == 2
    assert dict(res.quarantined) == {"invalid_json": 1, "missing_field": 1, "empty_field": 1, "too_long": 1,
                                     "invalid_utf8": 1}
    q = {e["reason"]: e for e in quarantined()}
    assert q["invalid_json"]["line"] == 2 and q["invalid_json"]["raw"] == "{not json"
    assert q["missing_field"]["record"] == {"instruction": "x"} and q["missing_field"]["file"] == str(p)
    assert q["invalid_utf8"]["line"] == 7 and "raw" in q["invalid_utf8"]
    assert len(ledger.db.execute("SELECT * FROM quarantine").fetchall()) == 5
    assert p.exists()  # nothing in the inbox is deleted


def test_a_file_is_read_once_and_duplicates_are_kept_once(env):
    inbox, ledger, do_pull, _ = env
    write_jsonl(inbox / "a.jsonl", [alpaca(1), alpaca(2)])
    assert do_pull().ingested["s"] == 2
    assert do_pull().files == 0  # same file: not read again
    shutil.copy(inbox / "a.jsonl", inbox / "copy-of-a.jsonl")
    assert do_pull().files == 0  # same content under another name: known by sha256
    write_jsonl(inbox / "b.jsonl", [alpaca(2), alpaca(3)])  # one old sample, one new
    res = do_pull()
    assert res.ingested["s"] == 1 and res.duplicates == 1
    assert ledger.backlog()[0] == 3


def test_json_array_parquet_and_csv(env):
    inbox, _ledger, do_pull, _ = env
    (inbox / "a.json").write_text(json.dumps([alpaca(1), {"prompt": "P?", "completion": "C."}]))
    datasets.Dataset.from_list([alpaca(2), alpaca(3)]).to_parquet(str(inbox / "b.parquet"))
    (inbox / "c.csv").write_text("instruction,input,output\nSay hi,,hi\nAdd,1 2,3\n")
    res = do_pull()
    assert res.files == 3 and res.ingested["s"] == 6 and not res.quarantined


def test_a_file_that_is_not_what_its_extension_says(env):
    inbox, _ledger, do_pull, quarantined = env
    (inbox / "fake.parquet").write_text("this is not parquet")
    (inbox / "obj.json").write_text(json.dumps({"instruction": "x", "output": "y"}))
    (inbox / "broken.json").write_text("[{")
    res = do_pull()
    assert res.quarantined == {"bad_file": 2, "invalid_json": 1}
    reasons = {os.path.basename(e["file"]): e["reason"] for e in quarantined()}
    assert reasons == {"fake.parquet": "bad_file", "obj.json": "bad_file", "broken.json": "invalid_json"}


def test_field_map_and_processed_dir(env):
    inbox, _ledger, do_pull, _ = env
    write_jsonl(inbox / "faq.jsonl", [{"q": "Why?", "a": "Because."}])
    res = do_pull(field_map={"q": "prompt", "a": "completion"}, move_processed=True)
    assert res.ingested["s"] == 1
    assert not (inbox / "faq.jsonl").exists() and (inbox / "processed" / "faq.jsonl").exists()
    assert do_pull(move_processed=True).files == 0


def test_files_still_being_written_wait_for_the_next_pull(env, tmp_path, tokenizer):
    inbox, ledger, _, _ = env
    write_jsonl(inbox / "new.jsonl", [alpaca(1)])
    cfg = SourceConfig(name="s", inbox=inbox, settle_seconds=3600)
    res = pull([cfg], ledger, tokenizer, run_id="r", quarantine=Quarantine(tmp_path / "q.jsonl"),
               max_seq_length=64, overlong="reject")
    assert res.files == 0
