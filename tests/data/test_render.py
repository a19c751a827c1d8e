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
