"""Preference records: every shape parsed to one normal form, bad ones quarantined naming field and line,
read by the pull exactly once."""

import json

import pytest

from jobs.data.formats import RecordError
from jobs.data.preference import is_pair, normalise_record, pair_messages
from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.store.ledger import Ledger
from tests.conftest import write_jsonl

USER = {"role": "user", "content": "Capital of France?"}
GOOD, BAD = "Paris.", "Lyon."


@pytest.mark.parametrize("record", [
    {"prompt": "Capital of France?", "chosen": GOOD, "rejected": BAD},
    {"messages": [USER], "chosen": {"role": "assistant", "content": GOOD}, "rejected": BAD},
    {"chosen": [USER, {"role": "assistant", "content": GOOD}], "rejected": [USER, {"role": "assistant",
                                                                                    "content": BAD}]},
    {"prompt": "Capital of France?", "completion": BAD, "edited": GOOD},
    {"prompt": "Capital of France?", "replies": [{"content": BAD, "rating": 2}, {"content": GOOD, "rating": 5},
                                                 {"content": BAD, "rating": "1"}]},
])
def test_every_preference_shape_is_one_pair(record):
    norm = normalise_record(record)
    assert is_pair(norm.record)
    chosen, rejected = pair_messages(norm.record)
    assert chosen == [USER, {"role": "assistant", "content": GOOD}]
    assert rejected == [USER, {"role": "assistant", "content": BAD}]
    # the same pair from any shape is the same sample (kept once)
    assert norm.hash == normalise_record({"prompt": USER["content"], "chosen": GOOD, "rejected": BAD}).hash


def test_a_good_rating_alone_is_a_supervised_record_and_a_bad_one_is_unpaired():
    norm = normalise_record({"prompt": "q", "completion": "a", "rating": True})
    assert norm.record == {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(RecordError) as e:
        normalise_record({"prompt": "q", "completion": "a", "rating": -1})
    assert e.value.reason == "unpaired" and "'rating'" in e.value.detail


@pytest.mark.parametrize("record, reason, field", [
    ({"prompt": "q", "chosen": "a"}, "missing_field", "'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, "wrong_type", "'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "unpaired", "'chosen'"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "empty_field", "'prompt'"),
    ({"chosen": "a", "rejected": "b"}, "missing_field", "'prompt'"),
    ({"messages": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"}, "wrong_type",
     "'messages'"),
    ({"prompt": "q", "replies": [{"content": "a", "rating": 1}, {"content": "b", "rating": 1}]}, "unpaired",
     "'replies'"),
    ({"prompt": "q", "replies": [{"content": "a", "rating": "high"}, {"content": "b", "rating": 1}]}, "wrong_type",
     "'replies[0].rating'"),
    ({"prompt": "q", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "wrong_type", "'chosen.role'"),
])
def test_bad_preference_records_name_the_field(record, reason, field):
    with pytest.raises(RecordError) as e:
        normalise_record(record)
    assert e.value.reason == reason and field in e.value.detail


def test_pull_reads_pairs_once_and_quarantines_bad_ones_with_their_line(tmp_path, tokenizer):
    inbox = tmp_path / "inbox"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    qfile = tmp_path / "q.jsonl"
    write_jsonl(inbox / "prefs.jsonl", [
        {"prompt": "Add 1 and 2.", "chosen": "3", "rejected": "4"},
        {"prompt": "Add 1 and 2.", "chosen": "3"},  # line 2: no rejected
        {"prompt": "Add 2 and 2.", "completion": "5", "edited": "4"},
        {"prompt": "Add 3 and 3.", "chosen": "6", "rejected": "word " * 200},  # line 4: rejected too long
        {"prompt": "Add 1 and 2.", "completion": "4", "edited": "3"},  # line 5: line 1's pair again
    ])
    src = SourceConfig(name="s", inbox=inbox, settle_seconds=0)

    def once(run):
        return pull([src], ledger, tokenizer, run_id=run, quarantine=Quarantine(qfile), max_seq_length=64,
                    overlong="reject", workers=0)

    res = once("r1")
    assert res.ingested["s"] == 2 and res.duplicates == 1
    assert dict(res.quarantined) == {"missing_field": 1, "too_long": 1}
    q = {r["line"]: r for r in map(json.loads, qfile.read_text().splitlines())}
    assert "'rejected'" in q[2]["detail"] and "'rejected'" in q[4]["detail"]
    assert q[2]["record"] == {"prompt": "Add 1 and 2.", "chosen": "3"}  # kept whole
    assert [is_pair(r.record) for r in ledger.samples_by_id([r.id for r in ledger.pending()])] == [True, True]
    assert once("r2").ingested["s"] == 0  # exactly once
