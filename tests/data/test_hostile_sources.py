"""A hostile data source, file by file: what a producer can write into an inbox (CSV quoting, encodings, missing
headers) costs one clear quarantine entry naming the file and line, never a flood of wrong ones, and the records
around it are read as written."""

from __future__ import annotations

import functools
import io
import json

import pytest

from jobs.data.csv_rows import read_csv
from jobs.data.pull import Quarantine, pull
from jobs.data.readers import Limits, read_json_array, read_jsonl
from jobs.data.sources import SourceConfig
from jobs.store.ledger import Ledger
from tests.conftest import alpaca


@pytest.fixture()
def env(env):
    """tests/data/conftest.py's, its pull without worker processes."""
    inbox, ledger, do_pull, quarantined = env
    return inbox, ledger, functools.partial(do_pull, workers=0), quarantined


def test_a_csv_record_too_large_or_not_utf8_is_skipped_to_its_end_and_the_rows_after_it_are_rows():
    """A quoted field of many lines over max_record_bytes (or holding a byte that is not UTF-8) is one quarantined
    record, from its first line; the reader used to start again inside the quoted field and quarantine each of
    its lines as a bad row (75,714 for one field of 600,000 lines), and could read its tail as rows."""
    lim = Limits(max_record_bytes=1024, excerpt_bytes=64)
    body = (b'instruction,output\nq1,a1\nq,"' + b"a,b\n" * 2000 + b'tail, "",x"\n'
            b'q2,"two\nlines, ""quoted"""\n'
            b'q3,"caf\xe9\nb,c\nd"\n'
            b'q4,a4\n')
    got = list(read_csv(io.BytesIO(body), lim))
    assert [(r.line, r.error.reason if r.error else r.record) for r in got] == [
        (2, {"instruction": "q1", "output": "a1"}),
        (3, "too_large"),
        (2004, {"instruction": "q2", "output": 'two\nlines, "quoted"'}),
        (2006, "invalid_utf8"),
        (2009, {"instruction": "q4", "output": "a4"}),
    ]
    big = got[1]
    assert big.size == len(b'q,"' + b"a,b\n" * 2000 + b'tail, "",x"\n') and big.sha256 and len(big.raw or "") <= 64
    assert "lines 3-2003" in big.error.detail


def test_a_csv_without_a_header_is_refused_whole_and_says_so(env):
    """A first line of data (or of ';'-separated names) is no header: the file is refused naming line 1 and what
    a header needs, instead of its first row silently taken as the header and every other row quarantined as
    'no known fields'. A header the source's field_map reads is a header."""
    inbox, _, do_pull, quarantined = env
    (inbox / "a.csv").write_text("What is 1?,It is 1.\nWhat is 2?,It is 2.\n")
    (inbox / "b.csv").write_text("instruction;output\nq;a\n")
    (inbox / "c.csv").write_text("question,answer\nWhat is 3?,It is 3.\n")
    res = do_pull(field_map={"question": "instruction", "answer": "output"})
    assert res.ingested["s"] == 1 and res.quarantined == {"bad_file": 2}
    q = {e["file"].rsplit("/", 1)[-1]: e for e in quarantined()}
    assert "line 1 names none of the fields" in q["a.csv"]["detail"] and "'What is 1?'" in q["a.csv"]["detail"]
    assert "';'" in q["b.csv"]["detail"]
    assert not [r for r in read_csv(io.BytesIO(b"What is 1?,It is 1.\nq,a\n"), Limits()) if r.error]  # no fields


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_files_are_refused_whole_with_their_encoding_named(encoding):
    """Read as UTF-8, a UTF-16 JSONL file was one error per line (invalid_utf8, then 'Expecting value' for each
    other line), a JSON or CSV file a row of bytes; now one bad_file that names the encoding."""
    bom = {"utf-16": b"", "utf-16-be": b"\xfe\xff", "utf-32": b""}[encoding]
    jsonl = bom + "".join(json.dumps(alpaca(i)) + "\n" for i in range(3)).encode(encoding)
    array = bom + json.dumps([alpaca(1)]).encode(encoding)
    table = bom + "instruction,output\nq,a\n".encode(encoding)
    for reader, data in ((read_jsonl, jsonl), (read_json_array, array), (read_csv, table)):
        [rec] = list(reader(io.BytesIO(data), Limits()))
        assert rec.line is None and rec.error is not None and rec.error.reason == "bad_file"
        assert encoding.upper()[:6] in rec.error.detail and "UTF-8" in rec.error.detail


def test_parquet_rows_are_measured_in_arrow_before_they_become_python_objects(tmp_path):
    """A compressed Parquet file is small on disk and huge decoded: rows were converted 256 at a time and measured
    as JSON (a 7 KB file with a 200 MB value took the check 1.9 GB). Now a row over max_record_bytes is quarantined
    unconverted, the others are converted a few MB at a time, and a row group whose column averages more than
    max_record_bytes a row (over 64 MiB, by the file's metadata) is not decoded at all."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.data.readers import read_parquet

    lim = Limits(max_record_bytes=1 << 20)
    medium = [f"{i:04d}" + "w" * 200_000 for i in range(300)]  # 60 MB decoded, in one row group
    medium[7] = "h" * (3 << 20)  # one row over the limit
    pq.write_table(pa.table({"instruction": [f"q{i}" for i in range(300)], "output": medium}),
                   tmp_path / "medium.parquet", compression="zstd")
    pq.write_table(pa.table({"instruction": ["big", "small"], "output": ["v" * (70 << 20), "ok"]}),
                   tmp_path / "bomb.parquet", compression="zstd")
    del medium
    tracemalloc.start()
    with open(tmp_path / "medium.parquet", "rb") as f:
        got = [(r.line, r.error.reason if r.error else r.record["output"][:4]) for r in read_parquet(f, lim)]
    with open(tmp_path / "bomb.parquet", "rb") as f:
        bomb = list(read_parquet(f, lim))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [(i + 1, "too_large" if i == 7 else f"{i:04d}") for i in range(300)]
    [rec] = bomb
    assert rec.line == 1 and rec.error is not None and rec.error.reason == "too_large"
    assert "row group 1 (rows 1-2)" in rec.error.detail and "'output'" in rec.error.detail
    assert peak < 24 << 20, f"reading took {peak / 1e6:.0f} MB of Python objects"


def test_a_file_rewritten_in_place_while_it_is_read_is_retried_even_with_its_mtime_set_back(env, monkeypatch):
    """Hashed, then read: a producer that rewrote the file between the two (same size, its mtime set back with
    utime) had the new records recorded under the old content's hash (the old records never read: known by that
    hash). The file's ctime, which no user can set back, is compared too: it is read again at the next pull."""
    import os

    import jobs.data.pull as pull_mod

    inbox, ledger, do_pull, quarantined = env
    p = inbox / "a.jsonl"
    p.write_text("".join(json.dumps(alpaca(i)) + "\n" for i in range(3)))
    real = pull_mod.read_stream

    def rewrite_then_read(fh, suffix, lim):
        st = os.stat(p)
        with open(p, "r+b") as f:
            f.write(p.read_bytes().replace(b"Add", b"Sum"))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        return real(fh, suffix, lim)

    monkeypatch.setattr(pull_mod, "read_stream", rewrite_then_read)
    res = do_pull()
    assert res.ingested["s"] == 0 and res.quarantined == {"unreadable": 1}
    assert "changed while it was read" in quarantined()[0]["detail"]
    assert ledger.db.execute("SELECT COUNT(*) FROM files").fetchone()[0] == 0
    monkeypatch.setattr(pull_mod, "read_stream", real)
    assert do_pull().ingested["s"] == 3


def test_a_conversation_the_chat_template_refuses_is_quarantined_in_its_words(env, tokenizer):
    """Many real templates raise on a conversation they do not take (roles that do not alternate, a system turn
    in the middle): that is the record's fault, said in the template's words (was: `internal_error`, as a bug)."""
    import copy

    inbox, _, _, quarantined = env
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}
    (inbox / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (alpaca(1), twice, alpaca(2))))
    ledger = Ledger(inbox.parent / "l2.sqlite")
    res = pull([SourceConfig(name="s", inbox=inbox, settle_seconds=0)], ledger, strict, run_id="r1",
               quarantine=Quarantine(inbox.parent / "quarantine" / "r1.jsonl"), max_seq_length=64,
               overlong="reject", workers=0)
    assert res.ingested["s"] == 2 and res.quarantined == {"wrong_type": 1}
    [e] = quarantined()
    assert e["line"] == 2 and "chat template refuses" in e["detail"] and "must alternate" in e["detail"]


def test_lines_that_end_in_a_carriage_return_alone_are_named_as_such():
    """Old Mac line ends make a whole JSONL or CSV file one line: the reason says so (it said 'Extra data' and
    'do you need to open the file in universal-newline mode?')."""
    [rec] = list(read_jsonl(io.BytesIO(b'{"text": "a"}\r{"text": "b"}\r'), Limits()))
    assert rec.error is not None and "carriage return alone" in rec.error.detail
    [rec] = list(read_csv(io.BytesIO(b"instruction,output\rq1,a1\rq2,a2\r"), Limits()))
    assert rec.error is not None and rec.error.reason == "bad_file" and "carriage return alone" in rec.error.detail


def test_a_parquet_file_naming_a_column_twice_is_refused_like_a_csv(env):
    """Two columns named 'output': a row kept the last one, silently; a CSV header doing so is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inbox, _, do_pull, quarantined = env
    table = pa.Table.from_arrays([pa.array(["q"]), pa.array(["a1"]), pa.array(["a2"])],
                                 names=["instruction", "output", "output"])
    pq.write_table(table, inbox / "a.parquet")
    res = do_pull()
    assert res.ingested["s"] == 0 and res.quarantined == {"bad_file": 1}
    assert "['output'] more than once" in quarantined()[0]["detail"]


def test_a_directory_named_like_data_is_reported_not_silently_skipped(env):
    """Spark and Hadoop write `x.parquet/` as a directory of part files: the inbox reads none of it, and says so
    in its log with how to read it (it was skipped without a word)."""
    from structlog.testing import capture_logs

    inbox, _, do_pull, _ = env
    (inbox / "x.parquet").mkdir()
    (inbox / "processed").mkdir()
    with capture_logs() as logs:
        res = do_pull()
    assert res.files == 0 and not res.quarantined
    [warn] = [e for e in logs if e["event"] == "directories_not_read"]
    assert warn["examples"] == ["x.parquet"] and "pattern with a '/'" in warn["detail"]


def test_a_flood_of_bad_records_is_counted_not_listed_past_a_bound(env, monkeypatch):
    """A file of 200,000 two-byte bad lines made a 36 MB quarantine, 31 MB of ledger rows and 67 MB of log: each
    record listed (quarantine file, ledger) up to KEPT_PER_FILE, logged up to LOGGED_PER_FILE, the rest one entry
    that counts them by reason; the night's counts stay whole."""
    from structlog.testing import capture_logs

    import jobs.data.pull as pull_mod

    monkeypatch.setattr(pull_mod, "KEPT_PER_FILE", 5)
    monkeypatch.setattr(pull_mod, "LOGGED_PER_FILE", 2)
    inbox, ledger, do_pull, quarantined = env
    (inbox / "a.jsonl").write_text("x\n" * 10 + json.dumps(alpaca(1)) + "\n" + '{"text": ""}\n' * 2)
    with capture_logs() as logs:
        res = do_pull()
    assert res.ingested["s"] == 1 and res.quarantined == {"invalid_json": 10, "empty_field": 2}
    q = quarantined()
    assert [e["line"] for e in q] == [1, 2, 3, 4, 5, None]
    assert q[-1]["reason"] == "invalid_json" and "7 more records" in q[-1]["detail"]
    assert "empty_field 2, invalid_json 5" in q[-1]["detail"]
    assert ledger.db.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0] == 6
    assert ledger.db.execute("SELECT quarantined FROM files").fetchone()[0] == 12
    assert sum(e["event"] == "record_quarantined" for e in logs) == 2
    [rest] = [e for e in logs if e["event"] == "records_quarantined_not_logged"]
    assert rest["count"] == 10


def test_a_processed_link_out_of_the_inbox_does_not_aim_the_moves(env, tmp_path):
    """With move_processed, a producer that puts a symbolic link named `processed` in the inbox had every ingested
    file moved to where it points (any directory the service may write); now the files stay where they are, are
    ingested all the same, and the link's target is untouched."""
    inbox, _, do_pull, _ = env
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (inbox / "processed").symlink_to(elsewhere)
    (inbox / "a.jsonl").write_text(json.dumps(alpaca(1)) + "\n")
    res = do_pull(move_processed=True)
    assert res.ingested["s"] == 1
    assert list(elsewhere.iterdir()) == [] and (inbox / "a.jsonl").exists()
    (inbox / "processed").unlink()
    (inbox / "b.jsonl").write_text(json.dumps(alpaca(2)) + "\n")
    assert do_pull(move_processed=True).ingested["s"] == 1
    assert sorted(p.name for p in (inbox / "processed").iterdir()) == ["a.jsonl", "b.jsonl"]  # a real one: moved


def test_the_record_ends_the_skipping_finds_are_the_csv_modules():
    """Skipping a record to its end follows the csv module's own quoting: on random snippets of quotes, commas,
    newlines and carriage returns, a record ends after the same lines for both (at the end of the data a record
    still inside quotes ends too)."""
    import csv
    import random

    from jobs.data.csv_rows import csv_state

    rng = random.Random(7)
    compared = 0
    for _ in range(3000):
        data = "".join(rng.choice('ab ,"\r\n') for _ in range(rng.randint(1, 30))) + "\n"
        lines = [x + "\n" for x in data.split("\n")[:-1]]
        taken: list[str] = []
        feed = iter(lines)

        def lines_read(feed=feed, taken=taken):
            for x in feed:
                taken.append(x)
                yield x

        try:
            theirs = [len(taken) for _ in csv.reader(lines_read())]
        except csv.Error:
            continue
        ours, state = [], 0
        for k, line in enumerate(lines, 1):
            state = csv_state(line.encode(), state)
            if state != 2:
                ours.append(k)
                state = 0
        ours += [len(lines)] if state == 2 else []
        assert ours == theirs, data
        compared += 1
    assert compared > 1000
