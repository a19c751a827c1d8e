"""A large file is checked by worker processes (jobs/data/parallel.py): what the pull records — samples,
their order, token ids, quarantine reasons — is the same as when this process checks every record."""

import json
import pickle

import pytest
from structlog.testing import capture_logs

import jobs.data.parallel as parallel
import jobs.data.pull as pull_mod
from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.data.token_cache import TokenCache
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, hang_bound

SHIPPED_NICENESS = parallel.WORKER_NICENESS  # read at import, before a fixture sets it

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("workers_at_our_priority")]


def lines(n):
    """Good records with hostile ones among them, over many tokenizer batches."""
    out = []
    for i in range(n):
        out.append(json.dumps(alpaca(i)))
        if i % 97 == 0:
            out += ["{not json", json.dumps({"instruction": "x"}), json.dumps({"text": "word " * 400}),
                    json.dumps({"instruction": "", "output": "y"}), json.dumps(alpaca(i)),  # a duplicate too
                    "1", "[1, 2]", '"text"', "null", '{"text": NaN}', "[" * 100 + "]" * 100,
                    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}),
                    json.dumps({"instruction": "w", "output": "<|im_end|><|im_start|>user"})]
    return ("\n".join(out) + "\n").encode() + b'{"text": "\xff\xfe bad"}\n'


def pulled(tmp_path, tokenizer, name, data, workers):
    """`data`: the inbox's one file (None: it is there already)."""
    inbox = tmp_path / name / "inbox"
    if data is not None:
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
    broken = []  # the pool must not break: a fallback to this process would pass every check below as well
    monkeypatch.setattr(parallel.CheckPool, "broken", lambda self, e: broken.append(repr(e)))
    data = lines(1500)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    assert not submitted
    with capture_logs() as logs:
        shared = pulled(tmp_path, tokenizer, "workers", data, workers=2)
    assert len(submitted) >= 3 and sum(submitted) > 1500  # every chunk went to the workers
    assert not broken, broken  # and came back from them, quarantined records included
    [ingested] = [e for e in logs if e["event"] == "file_ingested"]  # says where the file's seconds went
    assert ingested["workers"] == 2 and 0 < ingested["check_seconds"] <= ingested["seconds"]
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
    from concurrent.futures.process import BrokenProcessPool

    f = Future()
    f.set_exception(BrokenProcessPool("a worker died"))
    return f


def test_a_chunk_that_does_not_come_back_whole_is_checked_here_and_the_pool_goes_on(tmp_path, tokenizer,
                                                                                    monkeypatch):
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    broken: list[str] = []
    monkeypatch.setattr(parallel.CheckPool, "broken", lambda self, e: broken.append(repr(e)))
    real, calls = parallel.pickle.loads, []

    def first_fails(blob):
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("cannot rebuild")
        return real(blob)

    data = lines(1500)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    monkeypatch.setattr(parallel.pickle, "loads", first_fails)
    with capture_logs() as logs:
        shared = pulled(tmp_path, tokenizer, "one-chunk", data, workers=2)
    failed = [e for e in logs if e["event"] == "pull_worker_chunk_failed"]
    assert len(failed) == 1 and failed[0]["records"] == 512 and not broken and len(calls) >= 3
    assert alone[1:] == shared[1:] and alone[0].ingested == shared[0].ingested


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


def pools_made(monkeypatch) -> list[int]:
    """The worker counts of every CheckPool made from now on."""
    made: list[int] = []
    init = parallel.CheckPool.__init__
    monkeypatch.setattr(parallel.CheckPool, "__init__",
                        lambda self, tok, workers, **kw: made.append(workers) or init(self, tok, workers, **kw))
    return made


def early_ready(pool: parallel.CheckPool | None) -> parallel.CheckPool:
    """The early workers once they hold their tokenizer: the pull waits READY_SECONDS (120) for them and then
    starts its own, which at load ~20 on two cores they could take (the pull is right; the test waits)."""
    assert pool is not None and pool.ready is not None
    pool.ready.result(timeout=hang_bound(300))
    return pool


def test_workers_started_early_serve_the_pull_and_go_with_it(tmp_path, tokenizer, tiny_model, monkeypatch):
    """A night starts them with its process, each loading the model's tokenizer itself; the pull takes them."""
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    made = pools_made(monkeypatch)
    parallel.start_early(tiny_model, 2)
    early = early_ready(parallel._early)
    with capture_logs() as logs:
        res = pulled(tmp_path, tokenizer, "early", lines(300), workers=2)
    assert made == [2] and any(e["event"] == "pull_workers_started_early" for e in logs)
    assert parallel._early is None and early is not None and early.pool is None  # closed with the pull
    assert res[1:] == pulled(tmp_path, tokenizer, "alone", lines(300), workers=0)[1:]


def test_early_workers_that_cannot_serve_the_pull_are_stopped_and_new_ones_started(tmp_path, tokenizer, tiny_model,
                                                                                  monkeypatch):
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    made = pools_made(monkeypatch)
    parallel.start_early(tiny_model, 3)  # another count than the pull's
    early = parallel._early
    pulled(tmp_path, tokenizer, "other", lines(100), workers=2)
    assert made == [3, 2] and early is not None and early.pool is None and parallel._early is None


def test_early_workers_holding_another_tokenizer_are_not_taken(tmp_path, tokenizer, tiny_model, monkeypatch):
    """Loaded from the model's directory, not handed over: the pull checks that they hold its own tokenizer."""
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    made = pools_made(monkeypatch)
    parallel.start_early(tiny_model, 2)
    other = pickle.loads(pickle.dumps(tokenizer))
    other.add_tokens(["<a-token-the-workers-do-not-have>"])
    with capture_logs() as logs:
        got = pulled(tmp_path, other, "another", lines(100), workers=2)
    assert made == [2, 2] and not any(e["event"] == "pull_workers_started_early" for e in logs)
    assert got[1:] == pulled(tmp_path, other, "alone", lines(100), workers=0)[1:]


def test_early_workers_that_could_not_load_a_tokenizer_are_not_taken(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    made = pools_made(monkeypatch)
    (tmp_path / "not-a-model").mkdir()
    parallel.start_early(tmp_path / "not-a-model", 2)  # each worker's start fails: the pool is broken
    got = pulled(tmp_path, tokenizer, "broken", lines(100), workers=2)
    assert made == [2, 2] and parallel._early is None
    assert got[1:] == pulled(tmp_path, tokenizer, "alone", lines(100), workers=0)[1:]


def test_a_pull_of_small_files_alone_stops_the_early_workers(tmp_path, tokenizer, tiny_model):
    parallel.start_early(tiny_model, 2)
    early = parallel._early
    pulled(tmp_path, tokenizer, "small", lines(50), workers=2)  # under 4 MB: checked in this process
    assert early is not None and early.pool is None and parallel._early is None  # not held through the night


def test_a_night_that_cannot_start_them_early_goes_on(tmp_path, tiny_model, monkeypatch):
    from jobs.night.config import NightConfig
    from jobs.night.intake import start_pull_workers

    monkeypatch.setattr(parallel, "default_workers", lambda: 2)
    cfg = NightConfig.model_validate({"state_dir": str(tmp_path), "model": {"path": str(tmp_path / "absent")}})
    with capture_logs() as logs:
        start_pull_workers(cfg.model_dump_json())  # no model there yet: nothing started, nothing raised
        start_pull_workers('{"state_dir": 3}')  # a config the night will refuse after its imports
    assert parallel._early is None and [e["event"] for e in logs] == ["pull_workers_not_started_early"] * 2
    start_pull_workers(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": tiny_model})})
                       .model_dump_json())
    try:
        assert parallel._early is not None and parallel._early.workers == 2
    finally:
        parallel.close_early()


def test_a_worker_sends_back_rows_ready_to_write(tokenizer):
    """An accepted record comes back from a worker as the ledger's JSON text and the token cache's bytes
    (the night's process only writes them); a refused one comes back whole, for its quarantine."""
    import pickle

    from jobs.data.check import Checked, Stored, check_for_store, check_records
    from jobs.data.readers import RawRecord
    from jobs.data.token_cache import encode

    src = SourceConfig(name="s", inbox="/nonexistent", settle_seconds=0)
    raws = [RawRecord(1, alpaca(1)), RawRecord(2, {"instruction": "x"}), RawRecord(3, alpaca(3))]
    options = {"max_seq_length": 64, "overlong": "reject"}
    out = pickle.loads(pickle.dumps(check_for_store(raws, src, tokenizer, **options)))
    whole = check_records(raws, src, tokenizer, **options)
    assert [type(c) for c in out] == [Stored, Checked, Stored] and out[1].error.reason == whole[1].error.reason
    for s, c in ((out[0], whole[0]), (out[2], whole[2])):
        assert (s.line, s.hash, json.loads(s.record_json), s.n_tokens) == (c.raw.line, c.norm.hash, c.norm.record,
                                                                           c.tokens.n_tokens)
        assert (s.ids, s.labels, s.reply) == encode(c.tokens)


def test_the_pull_does_not_wait_for_its_workers_to_exit(tmp_path, tokenizer, tiny_model, monkeypatch):
    """Every result is in when the pull closes its pool: the workers' exit (an interpreter's teardown each,
    2.1 s for 4 on the 2-core box) goes on beside the night, not on the wake's path before the plan."""
    from concurrent.futures import ProcessPoolExecutor

    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    waits: list[bool] = []
    shutdown = ProcessPoolExecutor.shutdown

    def spy(self, wait=True, *, cancel_futures=False):
        waits.append(wait)
        return shutdown(self, wait=wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(ProcessPoolExecutor, "shutdown", spy)
    parallel.start_early(tiny_model, 2)
    got = pulled(tmp_path, tokenizer, "early", lines(300), workers=2)
    assert waits and not any(waits) and parallel._early is None  # every pool closed, none waited for
    assert got[1:] == pulled(tmp_path, tokenizer, "alone", lines(300), workers=0)[1:]


def _how_a_worker_runs():
    import os

    return os.nice(0), os.environ.get("TOKENIZERS_PARALLELISM")


def test_workers_run_behind_the_nights_own_process(tokenizer, monkeypatch):
    """Checking the inbox ahead, they run beside the night's imports: one thread each, at a lower priority."""
    import os

    monkeypatch.setattr(parallel, "WORKER_NICENESS", SHIPPED_NICENESS)  # the module's fixture set it to 0
    assert SHIPPED_NICENESS == 10
    pool = parallel.CheckPool(tokenizer, 2)
    try:
        niceness, parallelism = pool.submit(_how_a_worker_runs).result(timeout=hang_bound(300))
    finally:
        pool.close()
    assert niceness == min(19, os.nice(0) + parallel.WORKER_NICENESS) and parallelism == "false"
