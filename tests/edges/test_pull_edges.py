"""Issue 40, the pull's edges: a producer that appends after a pause, and a stop request mid-pull."""

import json
import threading
from typing import Any

import pytest

from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, write_jsonl


class Clock:
    """The ledger's clock (the pull's `now` for settle_seconds): moved by hand, never by the machine's load."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def env(tmp_path, tokenizer):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    clock = Clock(0.0)
    ledger = Ledger(tmp_path / "ledger.sqlite", clock=clock)

    def do_pull(stop: threading.Event | None = None, tok: Any = tokenizer, **src: Any):
        cfg = SourceConfig(name="s", inbox=inbox, **src)
        return pull([cfg], ledger, tok, run_id="r", quarantine=Quarantine(tmp_path / "q.jsonl"), max_seq_length=64,
                    overlong="reject", workers=0, **({"stop": stop} if stop is not None else {}))

    return inbox, ledger, clock, do_pull


def test_records_appended_after_a_pause_longer_than_settle_are_read_from_the_moved_file(env):
    """The audit's producer: keeps its file open, writes 10 lines, is idle past settle_seconds (the pull moves
    the file to processed/), then writes 10 more through the same descriptor. All 20 must be ingested."""
    inbox, ledger, clock, do_pull = env
    path = inbox / "feed.jsonl"
    with open(path, "a") as producer:
        for i in range(10):
            producer.write(json.dumps(alpaca(i)) + "\n")
        producer.flush()
        clock.t = path.stat().st_mtime + 60  # idle for a minute: longer than settle_seconds
        first = do_pull(move_processed=True, settle_seconds=30)
        assert first.ingested["s"] == 10 and not path.exists()  # moved while the producer still holds it
        for i in range(10, 20):
            producer.write(json.dumps(alpaca(i)) + "\n")
        producer.flush()
    moved = inbox / "processed" / "feed.jsonl"
    clock.t = moved.stat().st_mtime + 1  # still settling: not read yet, nothing lost either
    assert do_pull(move_processed=True, settle_seconds=30).ingested["s"] == 0
    clock.t = moved.stat().st_mtime + 60
    second = do_pull(move_processed=True, settle_seconds=30)
    assert second.ingested["s"] == 10 and second.duplicates == 10
    assert ledger.backlog()[0] == 20
    clock.t += 3600  # unchanged since: read no more
    assert do_pull(move_processed=True, settle_seconds=30).files == 0


def test_bytes_appended_between_the_read_and_the_move_are_not_lost(env, monkeypatch):
    """The producer writes after the pull read the file but before it moved it."""
    import jobs.data.pull as pull_mod

    inbox, ledger, clock, do_pull = env
    path = write_jsonl(inbox / "feed.jsonl", [alpaca(i) for i in range(3)])
    real_move = pull_mod.os.rename

    def late_write_then_move(src: Any, dst: Any, **kw: Any) -> Any:
        if str(src) == str(path):  # the move into processed/ (a rename into its directory)
            with open(src, "a") as f:
                f.write(json.dumps(alpaca(99)) + "\n")
        return real_move(src, dst, **kw)

    monkeypatch.setattr(pull_mod.os, "rename", late_write_then_move)
    clock.t = path.stat().st_mtime + 60
    assert do_pull(move_processed=True, settle_seconds=0).ingested["s"] == 3
    monkeypatch.setattr(pull_mod.os, "rename", real_move)
    clock.t += 60
    assert do_pull(move_processed=True, settle_seconds=0).ingested["s"] == 1
    assert ledger.backlog()[0] == 4


class StopOnFile:
    """A tokenizer that sets the stop event while the records of `marker` are being checked (SIGTERM arriving
    in the middle of a file)."""

    def __init__(self, tokenizer: Any, stop: threading.Event, marker: str) -> None:
        self._t, self._stop, self._marker = tokenizer, stop, marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._t(*a, **k)

    def apply_chat_template(self, messages: Any, *a: Any, **k: Any) -> Any:
        if self._marker in json.dumps(messages):
            self._stop.set()
        return self._t.apply_chat_template(messages, *a, **k)


def test_a_stop_request_ends_the_pull_mid_file_and_keeps_the_files_committed_before(env, tokenizer):
    inbox, ledger, clock, do_pull = env
    import os

    for n, name in enumerate(["a", "b", "c"]):
        p = write_jsonl(inbox / f"{name}.jsonl", [alpaca(i, f" ({name})") for i in range(5)])
        os.utime(p, (1000 + n, 1000 + n))  # read in this order (oldest first)
    clock.t = 10_000
    stop = threading.Event()
    res = do_pull(stop=stop, tok=StopOnFile(tokenizer, stop, "(b)"))
    assert res.stopped and res.files == 1 and res.ingested["s"] == 5  # a kept; b rolled back; c not read
    assert ledger.backlog()[0] == 5
    names = [r[0] for r in ledger.db.execute("SELECT path FROM files")]
    assert [n.rsplit("/", 1)[-1] for n in names] == ["a.jsonl"]
    again = do_pull()  # the next pull reads what the stop left
    assert again.files == 2 and ledger.backlog()[0] == 15
