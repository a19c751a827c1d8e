"""A large file is checked by worker processes (jobs/data/parallel.py): what the pull records — samples,
their order, token ids, quarantine reasons — is the same as when this process checks every record."""

import json

import jobs.data.parallel as parallel
import jobs.data.pull as pull_mod
from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.data.token_cache import TokenCache
from jobs.store.ledger import Ledger
from tests.conftest import alpaca


def lines(n):
    """Good records with hostile ones among them, over many tokenizer batches."""
    out = []
    for i in range(n):
        out.append(json.dumps(alpaca(i)))
        if i % 97 == 0:
            out += ["{not json", json.dumps({"instruction": "x"}), json.dumps({"text": "word " * 400}),
                    json.dumps({"instruction": "", "output": "y"}), json.dumps(alpaca(i))]  # a duplicate too
    return ("\n".join(out) + "\n").encode() + b'{"text": "\xff\xfe bad"}\n'


def pulled(tmp_path, tokenizer, name, data, workers):
    inbox = tmp_path / name / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "a.jsonl").write_bytes(data)
    ledger = Ledger(tmp_path / name / "ledger.sqlite")
    cache = TokenCache(tmp_path / name / "tokens", tokenizer, max_seq_length=64, overlong="reject")
    qfile = tmp_path / name / "quarantine.jsonl"
    try:
        res = pull([SourceConfig(name="s", inbox=inbox, settle_seconds=0)], ledger, tokenizer, run_id="r",
                   quarantine=Quarantine(qfile), max_seq_length=64, overlong="reject", token_cache=cache,
                   workers=workers)
        rows = ledger.db.execute("SELECT id, hash, line, n_tokens FROM samples ORDER BY id").fetchall()
        ids = cache._get([r["hash"] for r in rows])
    finally:
        cache.close()
        ledger.close()
    quarantine = [(q["line"], q["reason"]) for q in map(json.loads, qfile.read_text().splitlines())]
    return res, [tuple(r) for r in rows], ids, quarantine


def test_workers_record_what_this_process_records(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)  # every file counts as large
    submitted = []
    submit = parallel.ProcessPoolExecutor.submit
    monkeypatch.setattr(parallel.ProcessPoolExecutor, "submit",
                        lambda self, fn, *a, **kw: submitted.append(len(a[0])) or submit(self, fn, *a, **kw))
    data = lines(1500)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    assert not submitted
    shared = pulled(tmp_path, tokenizer, "workers", data, workers=2)
    assert len(submitted) >= 3 and sum(submitted) > 1500  # every chunk went to the workers
    assert alone[0].ingested == shared[0].ingested and alone[0].quarantined == shared[0].quarantined
    assert alone[0].duplicates == shared[0].duplicates > 0 and sum(alone[0].quarantined.values()) > 60
    assert alone[1:] == shared[1:]


def test_a_pool_that_breaks_hands_its_records_back(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)

    monkeypatch.setattr(parallel.ProcessPoolExecutor, "submit", lambda self, fn, *a, **kw: _failing_future())
    data = lines(300)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    shared = pulled(tmp_path, tokenizer, "broken", data, workers=2)
    assert alone[1:] == shared[1:] and alone[0].ingested == shared[0].ingested


def _failing_future():
    from concurrent.futures import Future

    f = Future()
    f.set_exception(RuntimeError("a worker died"))
    return f


def test_default_workers_leave_one_cpu_to_the_ledger_and_cap_at_eight(monkeypatch):
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert parallel.default_workers() == 0  # one worker beside the night gains nothing: none
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    assert parallel.default_workers() == 2
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert parallel.default_workers() == 8


def test_a_tokenizer_the_workers_cannot_take_is_used_here(tmp_path, tokenizer, monkeypatch):
    """No file is refused because the pool could not start: this process checks its records."""
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)

    class Unpicklable:
        def __init__(self, inner):
            self.inner, self.hook = inner, lambda: None  # a lambda: pickle refuses it

        def __getattr__(self, name):
            return getattr(self.inner, name)

    import pickle

    import pytest

    with pytest.raises(Exception):  # noqa: B017 (pickle raises one of several types)
        pickle.dumps(Unpicklable(tokenizer))
    data = lines(200)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    here = pulled(tmp_path, Unpicklable(tokenizer), "here", data, workers=2)
    assert alone[1:] == here[1:] and alone[0].ingested == here[0].ingested and not here[0].quarantined.get(
        "internal_error")
