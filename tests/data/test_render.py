import pytest

from jobs.data.batching import IGNORE_INDEX
from jobs.data.formats import RecordError
from jobs.data.render import tokenize_record


def trained_text(tok, s):
    return tok.decode([i for i, lab in zip(s.input_ids, s.labels, strict=True) if lab != IGNORE_INDEX])


def test_only_assistant_turns_are_trained(tokenizer):
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                        {"role": "assistant", "content": "6"}]}
    s = tokenize_record(tokenizer, 1, rec, max_seq_length=256)
    assert trained_text(tokenizer, s) == "4<|end|>\n6<|end|>\n"
    full = tokenizer.decode(s.input_ids)
    assert full.startswith("<|bos|><|system|>\nBe brief.")  # the chat template was applied


def test_raw_text_trains_everything_but_the_first_token(tokenizer):
    s = tokenize_record(tokenizer, 1, {"text": "hello world"}, max_seq_length=256)
    assert s.labels[0] == IGNORE_INDEX
    assert all(lab != IGNORE_INDEX for lab in s.labels[1:])


def test_overlong_reject_and_truncate(tokenizer):
    rec = {"text": "word " * 200}
    with pytest.raises(RecordError) as e:
        tokenize_record(tokenizer, 1, rec, max_seq_length=32)
    assert e.value.reason == "too_long"
    s = tokenize_record(tokenizer, 1, rec, max_seq_length=32, overlong="truncate")
    assert s.n_tokens == 32


def test_truncation_that_leaves_no_answer_is_rejected(tokenizer):
    rec = {"messages": [{"role": "user", "content": "long " * 100}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(RecordError):
        tokenize_record(tokenizer, 1, rec, max_seq_length=16, overlong="truncate")


def test_the_reply_mask_marks_the_replies_own_tokens_not_the_templates_markers(tokenizer):
    rec = {"messages": [{"role": "user", "content": "Capital of Norway?"},
                        {"role": "assistant", "content": "Oslo"}, {"role": "user", "content": "And Peru?"},
                        {"role": "assistant", "content": "Lima."}]}
    s = tokenize_record(tokenizer, 1, rec, max_seq_length=256)
    reply = tokenizer.decode([i for i, r in zip(s.input_ids, s.reply_mask, strict=True) if r])
    assert reply == "OsloLima." and trained_text(tokenizer, s) == "Oslo<|end|>\nLima.<|end|>\n"
    assert all(lab != IGNORE_INDEX for lab, r in zip(s.labels, s.reply_mask, strict=True) if r)
    text = tokenize_record(tokenizer, 1, {"text": "hello world"}, max_seq_length=256)
    assert text.reply_mask[1:] == [True] * (text.n_tokens - 2) + [False]  # the appended end-of-sequence is not


def test_token_flags_answer_as_a_scan_of_every_span():
    """Labels and reply masks ask, per token, whether its characters lie inside (or touch) a trained span; the
    ranges found by binary search must answer exactly as the scan they replaced: empty tokens, empty and
    touching spans, tokens out of text order, spans out of order."""
    import random

    from jobs.data.render import _AnySpans, token_flags

    rng = random.Random(0)
    for trial in range(3000):
        cuts = sorted(rng.randint(0, 60) for _ in range(2 * rng.randint(0, 4)))
        spans = list(zip(cuts[0::2], cuts[1::2], strict=True))
        if trial % 10 == 0:
            rng.shuffle(spans)
        pos, offsets = 0, []
        for _ in range(rng.randint(0, 25)):
            start = pos + rng.choice([0, 0, 1, 3])
            offsets.append((start, start + rng.choice([0, 1, 2, 4, 9])))
            pos = offsets[-1][1] if rng.random() < 0.9 else max(0, start - 3)  # now and then out of order
        scan = _AnySpans(spans)
        assert token_flags(offsets, spans, "inside") == [scan.contains(s, e) for s, e in offsets], (spans, offsets)
        assert token_flags(offsets, spans, "overlaps") == [scan.overlaps(s, e) for s, e in offsets], (spans, offsets)
