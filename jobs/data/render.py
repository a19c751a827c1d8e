"""Render a normalised record into token ids and labels.

Conversations go through the tokenizer's own chat template, so the adapter is trained
on exactly the format the inference server will use. Only assistant turns are
trained on: each assistant span is found by rendering the conversation's prefixes
(the text between "prefix + generation prompt" and "prefix + this turn"), which works
for any template whose prefixes render as string prefixes of the whole.
"""

from __future__ import annotations

from typing import Any, Literal

from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.data.formats import RecordError

OverlongPolicy = Literal["reject", "truncate"]


def char_spans(tokenizer: Any, record: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
    """The full training text and the character spans that are trained on."""
    if "text" in record:
        text = record["text"]
        if tokenizer.eos_token:
            text += tokenizer.eos_token
        return text, [(0, len(text))]
    messages = record["messages"]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not full.startswith(upto) or not upto.startswith(before):
            # Template rewrites earlier turns (e.g. strips reasoning): train on the last reply only.
            last = max(j for j, x in enumerate(messages) if x["role"] == "assistant")
            before = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
            return full, [(len(before), len(full))]
        spans.append((len(before), len(upto)))
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


def tokenize_record(
    tokenizer: Any, sample_id: int, record: dict[str, Any], *, max_seq_length: int,
    overlong: OverlongPolicy = "reject",
) -> TokenizedSample:
    text, spans = char_spans(tokenizer, record)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    labels = [
        tok if any(a <= start and end <= b and end > start for a, b in spans) else IGNORE_INDEX
        for tok, (start, end) in zip(ids, offsets, strict=True)
    ]
    replies = reply_char_spans(tokenizer, record, text, spans)
    # a token that overlaps the reply's text is part of the reply (BPE may merge its edge with a marker)
    reply = [any(start < b and end > a for a, b in replies) for start, end in offsets]
    if len(ids) > max_seq_length:
        if overlong == "reject":
            raise RecordError("too_long", f"{len(ids)} tokens > max_seq_length {max_seq_length}")
        ids, labels, reply = ids[:max_seq_length], labels[:max_seq_length], reply[:max_seq_length]
    labels[0] = IGNORE_INDEX  # the first token is never predicted (and packing relies on it)
    if all(x == IGNORE_INDEX for x in labels):
        raise RecordError("too_long", "no trainable token left within max_seq_length")
    mask = [r and lab != IGNORE_INDEX for r, lab in zip(reply, labels, strict=True)]
    return TokenizedSample(sample_id=sample_id, input_ids=ids, labels=labels, reply_mask=mask)
