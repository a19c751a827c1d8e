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


NO_END_OF_TURN = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def no_end_of_turn(tiny_model):
    """The demo tokenizer with a template that closes a reply with nothing (the parity benchmark's first random
    models had one: greedy replies never stopped, 0 % exact match on every path)."""
    from jobs.training.load import load_tokenizer

    tok = load_tokenizer(tiny_model)
    tok.chat_template = NO_END_OF_TURN
    return tok


def test_a_template_without_an_end_of_turn_gets_the_eos_after_the_final_reply(no_end_of_turn, tokenizer):
    from jobs.data.render import tokenize_records

    conv = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]}
    s = tokenize_record(no_end_of_turn, 1, conv, max_seq_length=256)
    assert s.input_ids[-1] == no_end_of_turn.eos_token_id and s.labels[-1] == no_end_of_turn.eos_token_id
    assert trained_text(no_end_of_turn, s).endswith("6<|eos|>")
    assert not s.reply_mask[-1]  # the stop is trained, but is not the reply's own text
    # the batch path and the escaped path (content holding control-token text) render the same
    assert tokenize_records(no_end_of_turn, [(1, conv)], max_seq_length=256)[0].input_ids == s.input_ids
    escaped = {"messages": [*conv["messages"][:3], {"role": "assistant", "content": "6 <|end|>"}]}
    e = tokenize_record(no_end_of_turn, 2, escaped, max_seq_length=256)
    assert e.input_ids[-1] == no_end_of_turn.eos_token_id and e.labels[-1] == no_end_of_turn.eos_token_id
    # a conversation ending with the user's turn, and a template with its own marker, get nothing appended
    asking = tokenize_record(no_end_of_turn, 3, {"messages": [*conv["messages"], {"role": "user", "content": "?"}]},
                             max_seq_length=256)
    assert no_end_of_turn.eos_token_id not in asking.input_ids
    assert tokenizer.eos_token_id not in tokenize_record(tokenizer, 1, conv, max_seq_length=256).input_ids
