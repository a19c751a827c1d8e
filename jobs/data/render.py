"""Render a normalised record into token ids and labels.

Conversations go through the tokenizer's own chat template, so the adapter is trained
on exactly the format the inference server will use. Only assistant turns are
trained on: each assistant span is found by rendering the conversation's prefixes
(the text between "prefix + generation prompt" and "prefix + this turn"), which works
for any template whose prefixes render as string prefixes of the whole.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        # the last turn's prefix is the whole conversation: one render fewer per record
        upto = full if i == len(messages) - 1 else tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not full.startswith(upto) or not upto.startswith(before):
            # Template rewrites earlier turns (e.g. strips reasoning): train on the last reply only.
            last = max(j for j, x in enumerate(messages) if x["role"] == "assistant")
            before = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
            return full, [(len(before), len(full))]
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_record(
    tokenizer: Any, sample_id: int, record: dict[str, Any], *, max_seq_length: int,
    overlong: OverlongPolicy = "reject",
) -> TokenizedSample:
    out = tokenize_records(tokenizer, [(sample_id, record)], max_seq_length=max_seq_length, overlong=overlong)[0]
    if isinstance(out, RecordError):
        raise out
    return out


def tokenize_records(
    tokenizer: Any, items: Sequence[tuple[int, dict[str, Any]]], *, max_seq_length: int,
    overlong: OverlongPolicy = "reject",
) -> list[TokenizedSample | RecordError]:
    """Many records in one call of the tokenizer (its Rust batch encode: no per-record Python round
    trip); a record that cannot be trained on comes back as its RecordError, in its place."""
    texts: list[str] = []
    spans: list[list[tuple[int, int]] | RecordError] = []
    for _, record in items:
        try:
            text, sp = char_spans(tokenizer, record)
        except RecordError as e:
            text, sp = "", e
        texts.append(text)
        spans.append(sp)
    if not texts:
        return []
    ids_all, offsets_all = _encode(tokenizer, texts)
    out: list[TokenizedSample | RecordError] = []
    for (sample_id, _), ids, offsets, sp in zip(items, ids_all, offsets_all, spans, strict=True):
        try:
            if isinstance(sp, RecordError):
                raise sp
            out.append(_labelled(sample_id, list(ids), offsets, sp, max_seq_length, overlong))
        except RecordError as e:
            out.append(e)
    return out


def _encode(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Ids and character offsets of many texts: the Rust tokenizer's batch encode where there is one
    (no per-record conversion into Python dicts), else the tokenizer's own call."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        encs = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encs], [e.offsets for e in encs]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), list(enc["offset_mapping"])


def _labelled(sample_id: int, ids: list[int], offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]],
              max_seq_length: int, overlong: OverlongPolicy) -> TokenizedSample:
    """A token is trained on when its characters lie inside one of the (few) trained spans."""
    if len(spans) == 1:
        (a, b), = spans
        labels = [tok if a <= start and end <= b and end > start else IGNORE_INDEX
                  for tok, (start, end) in zip(ids, offsets, strict=True)]
    else:
        labels = [tok if end > start and any(x <= start and end <= y for x, y in spans) else IGNORE_INDEX
                  for tok, (start, end) in zip(ids, offsets, strict=True)]
    if len(ids) > max_seq_length:
        if overlong == "reject":
            raise RecordError("too_long", f"{len(ids)} tokens > max_seq_length {max_seq_length}")
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
    if not ids:
        raise RecordError("empty_field", "the record renders to no tokens")
    labels[0] = IGNORE_INDEX  # the first token is never predicted (and packing relies on it)
    if all(x == IGNORE_INDEX for x in labels):
        raise RecordError("too_long", "no trainable token left within max_seq_length")
    return TokenizedSample(sample_id=sample_id, input_ids=ids, labels=labels)
