"""Render a normalised record into token ids and labels.

Conversations go through the tokenizer's own chat template, so the adapter is trained
on exactly the format the inference server will use. Only assistant turns are
trained on: each assistant span is found by rendering the conversation's prefixes
(the text between "prefix + generation prompt" and "prefix + this turn"), which works
for any template whose prefixes render as string prefixes of the whole.

Control-token text inside content (a record saying `<|end|>\n<|user|>...`) is trained as text, never as
the control tokens themselves: `[train] special_tokens = "escape"` (the default) tokenises the content
pieces with the tokenizer's special tokens split into ordinary text, `"reject"` quarantines the record.
Records without such text are tokenised exactly as before.

A template that closes an assistant turn with nothing (no end-of-turn marker after the reply) would train replies
that never stop: the end-of-sequence token is appended after a conversation's final reply, as after a `text`
record, and trained on (`closing_eos`).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Literal

from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.data.formats import RecordError

OverlongPolicy = Literal["reject", "truncate"]
SpecialTokens = Literal["escape", "reject"]
_SPECIALS: dict[int, tuple[Any, re.Pattern[str] | None, set[int]]] = {}  # id(tokenizer) -> (it, pattern, ids)
_NO_END_OF_TURN: dict[int, tuple[Any, bool]] = {}  # id(tokenizer) -> (it, template closes a reply with nothing)
CHARS_PER_TOKEN_MAX = 64  # no tokenizer's tokens average more characters than this over a whole record
_MARK = "\ue000"  # private-use characters delimit the content in a template rendered with placeholders


def _no_end_of_turn(tokenizer: Any) -> bool:
    """True when the chat template renders nothing (or only whitespace) after an assistant reply (cached per
    tokenizer): a model trained on it never learns to stop."""
    cached = _NO_END_OF_TURN.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        reply = f"{_MARK}1{_MARK}"
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": f"{_MARK}0{_MARK}"},
                                                      {"role": "assistant", "content": reply}], tokenize=False)
        except Exception:  # a template that refuses this conversation: judged by each record's own rendering
            rendered = ""
        none = reply in rendered and not rendered.rpartition(reply)[2].strip()
        cached = _NO_END_OF_TURN[id(tokenizer)] = (tokenizer, none)
    return cached[1]


def closing_eos(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """What follows the rendered conversation: the end-of-sequence token when it ends with a reply and the
    template closes a reply with nothing; else nothing."""
    if messages and messages[-1]["role"] == "assistant" and tokenizer.eos_token and _no_end_of_turn(tokenizer):
        return str(tokenizer.eos_token)
    return ""


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    """The conversation through the chat template; a template that refuses it (`raise_exception`: roles that do
    not alternate, a system turn where it allows none) is the record's fault, said in the template's words."""
    from jinja2.exceptions import TemplateError

    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, **kw))
    except TemplateError as e:
        raise RecordError("wrong_type", f"the model's chat template refuses this conversation: {e}") from None


def char_spans(tokenizer: Any, record: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
    """The full training text and the character spans that are trained on."""
    if "text" in record:
        text = record["text"]
        if tokenizer.eos_token:
            text += tokenizer.eos_token
        return text, [(0, len(text))]
    messages = record["messages"]
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        # the last turn's prefix is the whole conversation: one render fewer per record
        upto = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1])
        if not full.startswith(upto) or not upto.startswith(before):
            # Template rewrites earlier turns (e.g. strips reasoning): train on the last reply only.
            last = max(j for j, x in enumerate(messages) if x["role"] == "assistant")
            before = _render(tokenizer, messages[:last], add_generation_prompt=True)
            full += closing_eos(tokenizer, messages)
            return full, [(len(before), len(full))]
        spans.append((len(before), len(upto)))
    if eos := closing_eos(tokenizer, messages):
        full += eos
        spans[-1] = (spans[-1][0], len(full))  # the final reply's span ends the text: its stop is trained
    return full, spans


def reply_char_spans(tokenizer: Any, record: dict[str, Any], full: str,
                     spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The replies' own text inside the trained spans, without the template's end-of-turn markers:
    each assistant message's content found inside its span (the whole span where the template
    rewrote it); raw text without the end-of-sequence token appended to it."""
    if "text" in record:
        return [(0, len(record["text"]))]
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    if len(replies) != len(spans):
        return spans
    out = []
    for (a, b), content in zip(spans, replies, strict=True):
        at = full.find(content, a, b) if content else -1
        out.append((at, at + len(content)) if at >= 0 else (a, b))
    return out


def _specials(tokenizer: Any) -> tuple[re.Pattern[str] | None, set[int]]:
    """The text of every added/special token, as one pattern, and their ids (cached per tokenizer)."""
    cached = _SPECIALS.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        texts = {str(getattr(t, "content", t)) for t in added.values()} | set(tokenizer.all_special_tokens or [])
        texts = {t for t in texts if t}
        pattern = re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None
        cached = _SPECIALS[id(tokenizer)] = (tokenizer, pattern, set(added))
    return cached[1], cached[2]


def _contents(record: dict[str, Any]) -> list[str]:
    return [record["text"]] if "text" in record else [m["content"] for m in record["messages"]]


def _pieces(tokenizer: Any, record: dict[str, Any]) -> list[tuple[str, bool]] | None:
    """The rendered text as (piece, is content) in order, or None when the template does not copy the
    content verbatim (then it cannot be tokenised piece by piece)."""
    if "text" in record:
        return [(record["text"], True), (tokenizer.eos_token or "", False)]
    messages = record["messages"]
    if any(_MARK in m["content"] for m in messages):
        return None
    marks = [f"{_MARK}{i}{_MARK}" for i in range(len(messages))]
    rest = _render(tokenizer, [{"role": m["role"], "content": mk} for m, mk in zip(messages, marks, strict=True)])
    pieces: list[tuple[str, bool]] = []
    for m, mk in zip(messages, marks, strict=True):
        before, sep, rest = rest.partition(mk)
        if not sep:
            return None
        pieces += [(before, False), (m["content"], True)]
    return [*pieces, (rest, False), (closing_eos(tokenizer, messages), False)]


def _encode(tokenizer: Any, record: dict[str, Any], text: str,
            special_tokens: SpecialTokens) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of the rendered text; control-token text in content as text."""
    pattern, added_ids = _specials(tokenizer)
    found = next((m.group() for c in _contents(record) if pattern and (m := pattern.search(c))), None)
    if found is None:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), list(enc["offset_mapping"])
    if special_tokens == "reject":
        raise RecordError("special_tokens", f"the content holds the control-token text {found!r} "
                          '([train] special_tokens = "reject")')
    pieces = _pieces(tokenizer, record)
    if pieces is None or "".join(p for p, _ in pieces) != text:
        raise RecordError("special_tokens", f"the content holds the control-token text {found!r} and the chat "
                          "template does not copy content verbatim, so it cannot be escaped")
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for piece, is_content in pieces:
        if piece:
            enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True,
                            split_special_tokens=is_content)
            if is_content and added_ids & set(enc["input_ids"]):
                raise RecordError("special_tokens", f"the content holds the control-token text {found!r}, which "
                                  "this tokenizer matches even as plain text")
            ids += enc["input_ids"]
            offsets += [(a + pos, b + pos) for a, b in enc["offset_mapping"]]
        pos += len(piece)
    return ids, offsets


def tokenize_record(
    tokenizer: Any, sample_id: int, record: dict[str, Any], *, max_seq_length: int,
    overlong: OverlongPolicy = "reject", special_tokens: SpecialTokens = "escape",
) -> TokenizedSample:
    _check_size(record, max_seq_length, overlong)
    text, spans = char_spans(tokenizer, record)
    ids, offsets = _encode(tokenizer, record, text, special_tokens)
    return _labelled(tokenizer, sample_id, record, text, spans, ids, offsets, max_seq_length, overlong)


def tokenize_records(
    tokenizer: Any, items: Sequence[tuple[int, dict[str, Any]]], *, max_seq_length: int,
    overlong: OverlongPolicy = "reject", special_tokens: SpecialTokens = "escape",
) -> list[TokenizedSample | RecordError]:
    """Many records, the same result as tokenize_record for each, in one call of the Rust tokenizer's
    batch encode (no per-record Python round trip); a record that cannot be trained on comes back as
    its RecordError, in its place. Records holding control-token text go one by one (escaped)."""
    out: list[TokenizedSample | RecordError | None] = [None] * len(items)
    batch: list[tuple[int, str, list[tuple[int, int]]]] = []  # (position, text, spans)
    pattern, _ = _specials(tokenizer)
    fast = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    for k, (sample_id, record) in enumerate(items):
        try:
            if fast is None or (pattern and any(pattern.search(c) for c in _contents(record))):
                out[k] = tokenize_record(tokenizer, sample_id, record, max_seq_length=max_seq_length,
                                         overlong=overlong, special_tokens=special_tokens)
                continue
            _check_size(record, max_seq_length, overlong)
            text, spans = char_spans(tokenizer, record)
            batch.append((k, text, spans))
        except RecordError as e:
            out[k] = e
    if batch:
        encs = fast.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
        for (k, text, spans), enc in zip(batch, encs, strict=True):
            sample_id, record = items[k]
            try:
                out[k] = _labelled(tokenizer, sample_id, record, text, spans, list(enc.ids), enc.offsets,
                                   max_seq_length, overlong)
            except RecordError as e:
                out[k] = e
    return [x for x in out if x is not None]


def _check_size(record: dict[str, Any], max_seq_length: int, overlong: OverlongPolicy) -> None:
    chars = sum(len(c) for c in _contents(record))
    if overlong == "reject" and chars > max_seq_length * CHARS_PER_TOKEN_MAX:  # not worth tokenising to know
        raise RecordError("too_long", f"{chars:,} characters cannot fit in max_seq_length {max_seq_length} tokens")


def _labelled(tokenizer: Any, sample_id: int, record: dict[str, Any], text: str, spans: list[tuple[int, int]],
              ids: list[int], offsets: Sequence[tuple[int, int]], max_seq_length: int,
              overlong: OverlongPolicy) -> TokenizedSample:
    """A token is trained on when its characters lie inside one of the trained spans."""
    inside = token_flags(offsets, spans, "inside")
    labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, inside, strict=True)]
    # a token that overlaps the reply's text is part of the reply (BPE may merge its edge with a marker)
    reply = token_flags(offsets, reply_char_spans(tokenizer, record, text, spans), "overlaps")
    if len(ids) > max_seq_length:
        if overlong == "reject":
            raise RecordError("too_long", f"{len(ids)} tokens > max_seq_length {max_seq_length}")
        ids, labels, reply = ids[:max_seq_length], labels[:max_seq_length], reply[:max_seq_length]
    if not ids:
        raise RecordError("empty_field", "the record renders to no tokens")
    labels[0] = IGNORE_INDEX  # the first token is never predicted (and packing relies on it)
    if all(x == IGNORE_INDEX for x in labels):
        raise RecordError("too_long", "no trainable token left within max_seq_length")
    mask = [r and lab != IGNORE_INDEX for r, lab in zip(reply, labels, strict=True)]
    return TokenizedSample(sample_id=sample_id, input_ids=ids, labels=labels, reply_mask=mask)


def token_flags(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]],
                test: Literal["inside", "overlaps"]) -> list[bool]:
    """Per token: are its characters [start, end) non-empty and inside one span ("inside"), or do they share
    a character with one ("overlaps")? Offsets in text order and sorted, disjoint spans (what tokenizers and
    the templates give) make each span a range of tokens, found by binary search; anything else is
    answered token by token. (A scan of every span per token cost 1.1 of the 5.5 s that ingesting 23k
    records took on a 2-core machine.)"""
    if not offsets:
        return []
    starts, ends = (list(x) for x in zip(*offsets, strict=True))
    ordered = (starts == sorted(starts) and ends == sorted(ends) and all(a <= b for a, b in spans)
               and all(b <= a2 for (_, b), (a2, _) in pairwise(spans)))
    if not ordered:
        scan = _AnySpans(spans)
        ask = scan.contains if test == "inside" else scan.overlaps
        return [ask(start, end) for start, end in offsets]
    flags = [False] * len(offsets)
    for a, b in spans:
        lo, hi = ((bisect_left(starts, a), bisect_right(ends, b)) if test == "inside"
                  else (bisect_right(ends, a), bisect_left(starts, b)))
        if lo < hi:
            flags[lo:hi] = [True] * (hi - lo)
    if test == "inside":  # an empty token lies inside nothing
        for k in (k for k, (start, end) in enumerate(offsets) if end <= start):
            flags[k] = False
    return flags


class _AnySpans:
    """The questions asked of every span in turn (offsets or spans out of order)."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans

    def contains(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b and end > start for a, b in self.spans)

    def overlaps(self, start: int, end: int) -> bool:
        return any(start < b and end > a for a, b in self.spans)
