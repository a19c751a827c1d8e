"""The inbox's large JSONL files checked while the night's process imports (jobs/data/prefetch.py): what the
pull then records is what it records checking every record itself, whatever the file holds and wherever the
ranges split it; a file that changed since, a range that does not come back, a file already ingested are
handled as the pull always handled them."""

import io
import itertools
import json
from concurrent.futures import Future

import pytest
from structlog.testing import capture_logs

import jobs.data.parallel as parallel
import jobs.data.pull as pull_mod
from jobs.data.parallel import check_options
from jobs.data.prefetch import _seek_line, check_ahead, ranges_of, take
from jobs.data.readers import Limits, read_jsonl
from jobs.data.sources import SourceConfig
from tests.conftest import alpaca, hang_bound
from tests.data.test_pull_workers import early_ready, lines, pulled

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("workers_at_our_priority")]

HOSTILE = (b"\xef\xbb\xbf" + json.dumps(alpaca(1)).encode() + b"\r\n\n   \n{not json\n"
           + b'{"text": "' + b"x" * 300 + b'"}\n'  # longer than the limit below: skipped unread, its size kept
           + b'{"text": "\xff\xfe bad"}\n' + json.dumps(alpaca(2)).encode() + b"\n\n"
           + b"[" * 80 + b"]" * 80 + b"\n" + json.dumps(alpaca(3)).encode())  # no newline at the end


def seen(raws) -> list[tuple]:
    """What a record read says (a RecordError compares by identity)."""
    return [(r.line, r.record, r.error and (r.error.reason, r.error.detail), r.raw, r.size, r.sha256) for r in raws]


def whole(data: bytes, lim: Limits) -> list:
    return seen(read_jsonl(io.BytesIO(data), lim))


def in_ranges(data: bytes, lim: Limits, bounds: list[int]) -> list:
    out, fh = [], io.BytesIO(data)
    for start, end in itertools.pairwise(bounds):
        out += seen(read_jsonl(fh, lim, first_line=_seek_line(fh, start), stop=end))
    return out


def test_every_split_of_a_hostile_file_reads_the_records_the_whole_file_reads():
    """A record belongs to the range where its line starts: split anywhere (inside a byte-order mark, a CRLF, an
    over-long line, a multi-byte character), the ranges give the same records, line numbers and reasons."""
    lim = Limits(max_record_bytes=200, excerpt_bytes=40, max_depth=64)
    expected = whole(HOSTILE, lim)
    reasons = {r[2][0] for r in expected if r[2] is not None}
    assert {"invalid_json", "too_large", "invalid_utf8"} <= reasons and expected[0][:2] == (1, alpaca(1))
    for k in range(len(HOSTILE) + 1):
        assert in_ranges(HOSTILE, lim, [0, k, len(HOSTILE)]) == expected, k
    for n in (3, 7, 16):
        assert in_ranges(HOSTILE, lim, [len(HOSTILE) * i // n for i in range(n + 1)]) == expected


def test_ranges_cover_a_file_once_and_give_each_worker_a_few():
    for size, workers in ((1, 2), (5 << 20, 8), (300 << 20, 8), (4 << 20, 2)):
        r = ranges_of(size, workers)
        assert r[0][0] == 0 and r[-1][1] == size and all(a[1] == b[0] for a, b in itertools.pairwise(r))
        assert len(r) <= 4 * workers and (len(r) == 1 or min(b - a for a, b in r) >= (1 << 20) - 1)


@pytest.fixture()
def large(monkeypatch):
    """Every file counts as large (the pull's and the early workers' threshold alike)."""
    monkeypatch.setattr(pull_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr("jobs.data.prefetch.RANGE_BYTES", 4096)


def ahead_of(tmp_path, name, data, tiny_model):
    """The inbox of `pulled(tmp_path, ..., name, ...)` with `data` in it, checked ahead by early workers."""
    inbox = tmp_path / name / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "a.jsonl").write_bytes(data)
    pool = early_ready(parallel.start_early(tiny_model, 2))
    check_ahead(pool, [SourceConfig(name="s", inbox=inbox, settle_seconds=0)],
                options=check_options(max_seq_length=64, overlong="reject", special_tokens="escape"),
                excerpt_bytes=16384, now=2e9)
    return inbox, pool


def test_a_file_checked_ahead_is_recorded_as_the_pull_records_it(tmp_path, tokenizer, tiny_model, large):
    data = lines(1500)
    alone = pulled(tmp_path, tokenizer, "alone", data, workers=0)
    _, pool = ahead_of(tmp_path, "ahead", data, tiny_model)
    assert len(next(iter(pool.ahead.values())).ranges) > 2  # split over several workers' tasks
    with capture_logs() as logs:
        got = pulled(tmp_path, tokenizer, "ahead", None, workers=2)
    [ingested] = [e for e in logs if e["event"] == "file_ingested"]
    assert ingested["checked_ahead"] is True and not pool.ahead
    assert alone[1:] == got[1:] and alone[0].ingested == got[0].ingested
    assert alone[0].quarantined == got[0].quarantined and sum(got[0].quarantined.values()) > 60


def test_a_file_that_changed_after_it_was_checked_ahead_is_checked_again(tmp_path, tokenizer, tiny_model, large):
    inbox, pool = ahead_of(tmp_path, "changed", lines(400), tiny_model)
    for fut in next(iter(pool.ahead.values())).futures:
        assert fut is not None and fut.result(timeout=hang_bound(300))
    with open(inbox / "a.jsonl", "ab") as f:  # a record more since: another size, mtime and ctime
        f.write(json.dumps(alpaca(99999)).encode() + b"\n")
    data = (inbox / "a.jsonl").read_bytes()
    with capture_logs() as logs:
        got = pulled(tmp_path, tokenizer, "changed", None, workers=2)
    [ingested] = [e for e in logs if e["event"] == "file_ingested"]
    assert ingested["checked_ahead"] is False
    assert got[1:] == pulled(tmp_path, tokenizer, "alone", data, workers=0)[1:]


def test_a_range_that_does_not_come_back_is_checked_by_the_pull(tmp_path, tokenizer, tiny_model, large):
    data = lines(1500)
    _, pool = ahead_of(tmp_path, "lost", data, tiny_model)
    ahead = next(iter(pool.ahead.values()))
    lost: Future[bytes] = Future()
    lost.set_exception(RuntimeError("a worker's result that cannot be read"))
    ahead.futures[1] = lost
    with capture_logs() as logs:
        got = pulled(tmp_path, tokenizer, "lost", None, workers=2)
    assert [e["event"] for e in logs].count("pull_worker_chunk_failed") == 1
    assert got[1:] == pulled(tmp_path, tokenizer, "alone", data, workers=0)[1:]


def test_the_adapters_pulls_of_a_night_each_take_the_files_checked_ahead_for_them(tmp_path, tokenizer, tiny_model,
                                                                                   large, monkeypatch):
    """[[adapters]]: the early workers check every adapter's inbox while the night imports; the adapters pull one
    after another, and the workers wait, with what they checked, for the last pull (closed, the later pulls
    started workers of their own and checked their files again: 5.6-7.9 s each for an 8B night on an H200 host)."""
    made = []
    real_init = parallel.CheckPool.__init__

    def counting(self, *a, **kw):
        made.append(kw.get("model_path") is not None)
        real_init(self, *a, **kw)

    monkeypatch.setattr(parallel.CheckPool, "__init__", counting)
    data = {name: lines(150 + 50 * k) for k, name in enumerate(("one", "two", "three"))}
    inboxes = {}
    for name, blob in data.items():
        inboxes[name] = tmp_path / name / "inbox"
        inboxes[name].mkdir(parents=True)
        (inboxes[name] / "a.jsonl").write_bytes(blob)
    pool = early_ready(parallel.start_early(tiny_model, 2))
    options = check_options(max_seq_length=64, overlong="reject", special_tokens="escape")
    for name, inbox in inboxes.items():  # each adapter's sources, against its own ledger (jobs/night/intake.py)
        check_ahead(pool, [SourceConfig(name="s", inbox=inbox, settle_seconds=0)], options=options,
                    excerpt_bytes=16384, now=2e9, ledger_path=tmp_path / name / "ledger.sqlite")
    assert len(pool.ahead) == 3
    got = {}
    try:
        for k, name in enumerate(data):
            with capture_logs() as logs:
                got[name] = pulled(tmp_path, tokenizer, name, None, workers=2)
            [ingested] = [e for e in logs if e["event"] == "file_ingested"]
            assert ingested["checked_ahead"] is True, name
            last = k == len(data) - 1
            assert (parallel._early is pool) is not last and (pool.pool is None) is last  # kept until the last
    finally:
        parallel.close_early()
    assert made == [True] and pool.pool is None and parallel._early is None  # one pool for the three pulls
    for name, blob in data.items():  # recorded as a pull checking every record itself records them
        alone = pulled(tmp_path / "alone", tokenizer, name, blob, workers=0)
        assert alone[1:] == got[name][1:] and alone[0].ingested == got[name][0].ingested


def test_a_pull_lets_its_early_workers_go_when_nothing_waits_for_a_later_pull(tmp_path, tokenizer, tiny_model, large):
    _, pool = ahead_of(tmp_path, "only", lines(200), tiny_model)
    pulled(tmp_path, tokenizer, "only", None, workers=2)
    assert parallel._early is None and pool.pool is None and not pool.ahead


def test_files_the_ledger_knows_are_not_checked_ahead_again(tmp_path, tokenizer, tiny_model, large):
    """An inbox that keeps its files (no move_processed) is not checked again every night."""
    from jobs.data.pull import Quarantine, pull
    from jobs.store.ledger import Ledger

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.jsonl").write_bytes(lines(300))
    src = SourceConfig(name="s", inbox=inbox, settle_seconds=0)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    pull([src], ledger, tokenizer, run_id="r", quarantine=Quarantine(tmp_path / "q.jsonl"), max_seq_length=64,
         overlong="reject", workers=0)
    ledger.close()
    (inbox / "b.jsonl").write_bytes(lines(200))
    pool = parallel.start_early(tiny_model, 2)
    try:
        check_ahead(pool, [src], options=check_options(max_seq_length=64, overlong="reject", special_tokens="escape"),
                    excerpt_bytes=16384, now=2e9, ledger_path=tmp_path / "ledger.sqlite")
        assert [p.rsplit("/", 1)[-1] for p in pool.ahead] == ["b.jsonl"]
    finally:
        parallel.close_early()


def test_results_checked_with_other_settings_are_not_taken(tmp_path, tokenizer, tiny_model, large):
    _, pool = ahead_of(tmp_path, "other", lines(300), tiny_model)
    [ahead] = pool.ahead.values()
    other = check_options(max_seq_length=32, overlong="reject", special_tokens="escape")
    assert take(pool, ahead.file.real, ahead.key, ahead.src, other, ahead.limits) is None and not pool.ahead
    parallel.close_early()


def test_the_night_checks_its_inbox_ahead_from_its_config(tmp_path, tiny_model, large, monkeypatch):
    """What the child starts before its imports, from the night's config JSON: with the config's own settings."""
    from jobs.night.config import NightConfig
    from jobs.night.intake import start_pull_workers

    monkeypatch.setattr(parallel, "default_workers", lambda: 2)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.jsonl").write_bytes(lines(300))
    (inbox / "b.csv").write_text("instruction,output\nx,y\n")  # not JSONL: checked by the pull as always
    cfg = NightConfig.model_validate({"state_dir": str(tmp_path / "state"), "model": {"path": str(tiny_model)},
                                      "sources": [{"name": "s", "inbox": str(inbox), "settle_seconds": 0}],
                                      "train": {"max_seq_length": 96}})
    start_pull_workers(cfg.model_dump_json())
    try:
        [ahead] = parallel._early.ahead.values()
        assert ahead.file.real == (inbox / "a.jsonl").resolve() and ahead.src == cfg.sources[0]
        assert ahead.options == check_options(max_seq_length=96, overlong=cfg.train.overlong,
                                              special_tokens=cfg.train.special_tokens)
    finally:
        parallel.close_early()


def test_an_older_ledger_is_not_copied_before_the_imports(tmp_path):
    """A ledger of an older schema would be read through a migrated copy in memory: before the imports that is
    not worth it (the night migrates it); a damaged one is not read either. Then every large file is checked."""
    import sqlite3

    from jobs.data.prefetch import _ledger
    from jobs.store.schema import SCHEMA

    old = sqlite3.connect(tmp_path / "old.sqlite")
    old.executescript(SCHEMA)
    old.commit()
    old.close()
    (tmp_path / "damaged.sqlite").write_bytes(b"not a database" * 100)
    assert _ledger(tmp_path / "old.sqlite") is None and _ledger(tmp_path / "damaged.sqlite") is None
    assert _ledger(tmp_path / "absent.sqlite") is None and _ledger(None) is None
