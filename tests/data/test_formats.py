import pytest

from jobs.data.formats import RecordError, normalise


def test_alpaca_with_and_without_input():
    a = normalise({"instruction": "Sort", "input": "b, a", "output": "a, b"})
    assert a.record == {"messages": [{"role": "user", "content": "Sort\n\nb, a"},
                                     {"role": "assistant", "content": "a, b"}]}
    b = normalise({"instruction": "Hi", "output": "Hello"})
    assert b.record["messages"][0]["content"] == "Hi"


def test_same_content_in_two_formats_hashes_the_same():
    a = normalise({"instruction": "Q?", "output": "A."})
    b = normalise({"prompt": "Q?", "completion": "A."})
    c = normalise({"messages": [{"role": "user", "content": " Q? "}, {"role": "assistant", "content": "A."}]})
    assert a.hash == b.hash == c.hash


def test_field_map_renames_operator_fields():
    n = normalise({"question": "Q?", "answer": "A."}, field_map={"question": "prompt", "answer": "completion"})
    assert n.record["messages"][1]["content"] == "A."


def test_text_format():
    assert normalise({"text": "just text"}).record == {"text": "just text"}


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"instruction": "Q"}, "missing_field"),
        ({"instruction": "  ", "output": "x"}, "empty_field"),
        ({"instruction": 3, "output": "x"}, "wrong_type"),
        ({"messages": "hi"}, "wrong_type"),
        ({"messages": []}, "empty_field"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "missing_field"),
        ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "wrong_type"),
        ({"unrelated": 1}, "missing_field"),
        ([1, 2], "wrong_type"),
    ],
)
def test_invalid_records_have_a_reason(record, reason):
    with pytest.raises(RecordError) as e:
        normalise(record)
    assert e.value.reason == reason
    assert e.value.detail


def test_explicit_format_is_enforced():
    with pytest.raises(RecordError) as e:
        normalise({"text": "x"}, fmt="alpaca")
    assert e.value.reason == "missing_field" and "instruction" in e.value.detail


@pytest.mark.parametrize("record", [{"prompt": "Q", "completion": None}, {"instruction": "Q", "output": None},
                                    {"messages": None}, {"text": None}])
def test_a_field_written_as_null_is_called_null_not_missing(record):
    """`{"completion": null}` was reported as "missing" (issue 42): the operator looks for a key that is there."""
    with pytest.raises(RecordError) as e:
        normalise(record)
    assert e.value.reason == "wrong_type" and "is null" in e.value.detail and "missing" not in e.value.detail
    assert normalise({"instruction": "Q", "input": None, "output": "A"}).record["messages"][0]["content"] == "Q"
