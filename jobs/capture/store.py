"""What the capture path keeps: the replies it served (for feedback to name) and the feedback as inbox records.

Durability: a feedback is acknowledged only after its record is in the inbox for good: written to a temporary
name, fsynced, renamed into place and the directory fsynced (a kill -9 at any point leaves either no file,
and no acknowledgement, or the whole file). Captures are not acknowledged to anyone, so they go through a
bounded queue to a journal written by one thread (the served reply never waits for a disk); a full queue
drops the capture and counts it. Memory: at most `max_captures` replies; disk: the journal is rotated at
`max_journal_bytes` (one older generation kept) and feedback is refused once `max_inbox_bytes` of feedback
files wait in the inbox. Everything is redacted by the operator's rules before it is held or written.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.capture.config import CaptureConfig, Redactor
from jobs.contract import crashpoints
from jobs.hotswap.core import parse_served_name

log = structlog.get_logger("nightshift.capture")
JOURNAL = "captures.jsonl"
FILE_PREFIX = "capture-"
SETTLE_SECONDS = 5.0  # how long feedback on an unknown id, or a stop, waits for the replies still in flight
CRASH_BEFORE_RENAME = crashpoints.declare("capture.feedback_before_rename",
                                          "a feedback record fsynced under its temporary name (not acknowledged)")
CRASH_AFTER_RENAME = crashpoints.declare("capture.feedback_after_rename",
                                         "a feedback record renamed into the inbox, directory fsynced, not yet "
                                         "acknowledged")


class Capture(BaseModel):
    """One served chat completion: the conversation before the reply, the reply, who served it."""

    model_config = ConfigDict(extra="forbid")
    id: str
    at: float
    model: str | None  # the served model/adapter name as the server reported it (e.g. tiny-v0003)
    version: int | None  # the nightshift version in that name, where it is one
    messages: list[dict[str, str]]
    reply: str

    @property
    def prompt_key(self) -> str:
        return hashlib.sha256(json.dumps(self.messages, sort_keys=True).encode()).hexdigest()


class Feedback(BaseModel):
    """POST /nightshift/feedback: a rating of a reply, an edit of it, or a choice between two replies."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, description="the reply rated or edited (the completion's id)")
    rating: float | bool | None = None
    edited: str | None = None
    chosen: str | None = Field(None, description="a choice: the preferred reply's id")
    rejected: str | None = Field(None, description="a choice: the other reply's id (same conversation)")

    @model_validator(mode="after")
    def _one_kind(self) -> Feedback:
        kinds = [self.rating is not None, self.edited is not None, self.chosen is not None or self.rejected is not None]
        if sum(kinds) != 1:
            raise ValueError("give exactly one of: 'rating', 'edited', or 'chosen' with 'rejected'")
        if kinds[2] and not (self.chosen and self.rejected):
            raise ValueError("a choice needs both 'chosen' and 'rejected' (the ids of two replies)")
        if (kinds[0] or kinds[1]) and not self.id:
            raise ValueError("a rating or an edit needs 'id' (the reply's id)")
        return self

    @property
    def kind(self) -> str:
        return "rating" if self.rating is not None else "edit" if self.edited is not None else "choice"


class FeedbackError(Exception):
    """Refused feedback (not acknowledged): `status` is the HTTP status that says why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def record_kind(record: dict[str, Any]) -> str:
    if "chosen" in record or "edited" in record:
        return "pair"
    rating = record.get("rating")
    return "supervised" if (rating is True or (not isinstance(rating, bool) and (rating or 0) > 0)) else "rating"


def served_version(model: str | None) -> int | None:
    """The nightshift version a reply came from: its `model` is the name the hot-swap loaded it under
    (`tiny-v0007-1a2b3c4d`, or an older server's `tiny-v0007`); None for a base model or a foreign adapter."""
    parsed = parse_served_name(model) if model else None
    return parsed[1] if parsed else None


class CaptureStore:
    def __init__(self, cfg: CaptureConfig, *, clock: Callable[[], float] = time.time,
                 on_drop: Callable[[], None] = lambda: None, on_capture: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.clock, self.on_drop, self.on_capture = cfg, clock, on_drop, on_capture
        self.redact = Redactor(cfg.redact)
        cfg.state.mkdir(parents=True, exist_ok=True)
        cfg.inbox.mkdir(parents=True, exist_ok=True)
        self.journal = cfg.state / JOURNAL
        for tmp in cfg.inbox.glob(f".{FILE_PREFIX}*.tmp"):  # a kill before the rename: never acknowledged
            tmp.unlink(missing_ok=True)
        self.held: OrderedDict[str, Capture] = OrderedDict()
        self.good: dict[str, str] = {}  # prompt key -> id of a reply rated good (pairs a later bad rating)
        self.lock = threading.Lock()
        self.settled = threading.Condition(self.lock)
        self.in_flight = 0  # replies sent whose capture is not held yet (feedback on them waits a moment)
        self.closed = False  # the journal's writer is told to end: a capture now is dropped, not queued behind it
        self.seq = itertools.count()
        self._load()
        self.q: queue.Queue[Capture | None] = queue.Queue(cfg.queue)
        self.writer = threading.Thread(target=self._write_loop, name="capture-journal", daemon=True)
        self.writer.start()

    # ---- captures ----

    def add(self, capture: Capture) -> bool:
        """Held for feedback at once; journaled by the writer thread. False: the queue was full, or the store closed
        (dropped). Counted before it is held: whoever sees it held sees it counted."""
        capture = Capture.model_validate(self.redact(capture.model_dump()))
        with self.lock:  # the journal's end is queued under it too: nothing is queued behind the end
            queued = not self.closed
            if queued:
                try:
                    self.q.put_nowait(capture)
                except queue.Full:
                    queued = False
        if not queued:
            self.on_drop()
            return False
        self.on_capture()
        self._hold(capture)
        return True

    def begin(self) -> None:
        """A reply is about to be captured: feedback naming an unknown id waits for it (the client may have the
        reply, and send feedback on it, before the capture is parsed)."""
        with self.lock:
            self.in_flight += 1

    def end(self) -> None:
        with self.lock:
            self.in_flight -= 1
            self.settled.notify_all()

    def _hold(self, capture: Capture) -> None:
        with self.lock:
            self.held[capture.id] = capture
            self.held.move_to_end(capture.id)
            while len(self.held) > self.cfg.max_captures:
                self.held.popitem(last=False)

    def get(self, cid: str) -> Capture:
        with self.lock:
            self.settled.wait_for(lambda: cid in self.held or self.in_flight == 0, timeout=SETTLE_SECONDS)
            c = self.held.get(cid)
        if c is None:
            raise FeedbackError(404, f"no captured reply with id {cid!r} (unknown, or older than the "
                                f"{self.cfg.max_captures} replies kept)")
        return c

    def _write_loop(self) -> None:
        while (c := self.q.get()) is not None:
            try:
                line = (c.model_dump_json() + "\n").encode()
                if self.journal.exists() and self.journal.stat().st_size + len(line) > self.cfg.max_journal_bytes:
                    self.journal.replace(self.journal.with_suffix(".1.jsonl"))
                with open(self.journal, "ab") as f:
                    f.write(line)
            except OSError as e:  # a full disk: captures are lost, served replies are not touched
                log.error("capture_journal_write_failed", error=str(e))
                self.on_drop()

    def _load(self) -> None:
        """The last `max_captures` replies of the journal (its older generation first): feedback after a restart."""
        for path in (self.journal.with_suffix(".1.jsonl"), self.journal):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                for line in f:
                    try:
                        self._hold(Capture.model_validate_json(line))
                    except ValueError:
                        continue  # a line cut by a kill: that capture alone is lost

    def close(self) -> None:
        """The replies still in flight get SETTLE_SECONDS to be captured, then the journal is ended and written out:
        a stop of the capture path loses no reply the client had whole (it was queued after the end, never written,
        yet counted captured). One later than that is dropped and counted."""
        with self.lock:
            self.settled.wait_for(lambda: self.in_flight == 0, timeout=SETTLE_SECONDS)
            self.closed = True
            self.q.put(None)  # blocks only while the queue is full: the writer empties it without this lock
        self.writer.join(timeout=30)

    # ---- feedback ----

    def feedback(self, fb: Feedback) -> list[tuple[str, str]]:
        """The records this feedback makes, durable in the inbox before this returns (then it is acknowledged):
        (kind, file name) of each; kind: pair (chosen over rejected, an edit), supervised (a good rating),
        rating (a bad rating no good one pairs yet: the pull quarantines it as unpaired, kept)."""
        records = self._records(fb)
        self._check_room()
        return [(record_kind(r), self._write_record(r)) for r in records]

    def _records(self, fb: Feedback) -> list[dict[str, Any]]:
        if fb.kind == "choice":
            a, b = self.get(fb.chosen or ""), self.get(fb.rejected or "")
            if a.messages != b.messages:
                raise FeedbackError(409, "'chosen' and 'rejected' answer different conversations")
            return [self._pair(a, a.reply, b.reply, via="choice", other=b.id)]
        c = self.get(fb.id or "")
        if fb.kind == "edit":
            edited = self.redact((fb.edited or "").strip())
            if not edited:
                raise FeedbackError(422, "field 'edited' is empty")
            return [{**self._base(c, "edit"), "completion": c.reply, "edited": edited}]
        good = bool(fb.rating > 0) if not isinstance(fb.rating, bool) else fb.rating  # type: ignore[operator]
        out = [{**self._base(c, "rating"), "completion": c.reply, "rating": fb.rating}]
        with self.lock:
            other = self.good.get(c.prompt_key)
            if good:
                self.good[c.prompt_key] = c.id
                while len(self.good) > self.cfg.max_captures:
                    self.good.pop(next(iter(self.good)))
        if not good and other is not None and other in self.held:  # a bad rating meets a good one: a pair
            g = self.get(other)
            if g.reply != c.reply:
                out.append(self._pair(c, g.reply, c.reply, via="ratings", other=g.id))
        return out

    def _base(self, c: Capture, via: str) -> dict[str, Any]:
        return {"messages": c.messages, "capture_id": c.id, "model": c.model, "version": c.version,
                "feedback": via, "at": self.clock()}

    def _pair(self, c: Capture, chosen: str, rejected: str, *, via: str, other: str) -> dict[str, Any]:
        return {**self._base(c, via), "chosen": chosen, "rejected": rejected, "other_id": other}

    def _check_room(self) -> None:
        waiting = sum(p.stat().st_size for p in self.cfg.inbox.glob(f"{FILE_PREFIX}*.jsonl"))
        if waiting >= self.cfg.max_inbox_bytes:
            raise FeedbackError(507, f"{waiting:,} bytes of feedback wait in {self.cfg.inbox} (max_inbox_bytes "
                                f"{self.cfg.max_inbox_bytes:,}): refused, not acknowledged")

    def _write_record(self, record: dict[str, Any]) -> str:
        name = f"{FILE_PREFIX}{time.time_ns()}-{os.getpid()}-{next(self.seq)}.jsonl"
        final = self.cfg.inbox / name
        tmp = self.cfg.inbox / f".{name}.tmp"  # matches no inbox pattern: never read half-written
        with open(tmp, "wb") as f:
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        crashpoints.reached(CRASH_BEFORE_RENAME)
        tmp.replace(final)
        fd = os.open(self.cfg.inbox, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        crashpoints.reached(CRASH_AFTER_RENAME)
        return name
