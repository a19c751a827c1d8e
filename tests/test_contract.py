"""The contract between the night's parts: what crosses the pipe is validated where it is read."""

from __future__ import annotations

import json

import pytest

from jobs.contract import (
    CalibrationRecord,
    ExitCode,
    MemoryModel,
    Outcome,
    ProgressEvent,
    ResultEvent,
    RunSummary,
    outcome_exit_code,
    parse_event,
    parse_version_name,
    version_name,
)


def record(**over):
    base = {"tokens_per_step": 7936, "gradient_checkpointing": False,
            "memory": {"static_gb": 8.2, "mb_per_token": 3.4}, "tokens_per_second": {"alpaca": 15039, "wiki": 14633},
            "max_vram_gb": 40, "device": "NVIDIA H200"}
    return {**base, **over}


def test_every_event_kind_round_trips_through_its_json_line():
    summary = RunSummary(run_id="r", outcome="succeeded", steps=3, backlog_samples=0)
    events = [ProgressEvent(fraction=0.5, tokens=10, steps=1), ResultEvent(summary=summary),
              parse_event({"event": "phase", "phase": "train", "state": "start"}),
              parse_event({"event": "gpu", "power_watts": 300.0}),
              parse_event({"event": "oom_split", "tokens": 40, "halves": [20, 20]}),
              parse_event({"event": "hotswap", "version": 2, "outcome": {"target": "t", "kind": "vllm", "ok": True}})]
    for ev in events:
        again = parse_event(ev.model_dump_json().encode())
        assert again == ev and type(again) is type(ev)
    assert parse_event(events[1].model_dump_json()).summary.outcome is Outcome.succeeded


@pytest.mark.parametrize("bad", [
    '{"event": "progress", "fraction": 1.5}',  # out of range
    '{"event": "phase", "phase": "dance", "state": "start"}',  # unknown phase
    '{"event": "telepathy"}',  # unknown kind
    '{"event": "result", "summary": {"outcome": "great"}}',  # unknown outcome
    '{"event": "progress", "fraction": 0.1, "surprise": 1}',  # unknown field
    "not json",
])
def test_a_malformed_event_is_refused_with_a_reason(bad):
    with pytest.raises(ValueError, match="not a child event"):
        parse_event(bad)


def test_the_calibration_record_is_typed_not_strings():
    rec = CalibrationRecord.model_validate_json(json.dumps(record()))
    assert rec.gradient_checkpointing is False and isinstance(rec.tokens_per_step, int)
    assert rec.slowest_tokens_per_second == 14633
    assert rec.shape().gradient_checkpointing is False and rec.shape().tokens_per_step == 7936
    with pytest.raises(ValueError):
        CalibrationRecord.model_validate(record(gradient_checkpointing="sometimes"))
    with pytest.raises(ValueError):
        CalibrationRecord.model_validate(record(tokens_per_step="lots"))


def test_memory_model_units():
    m = MemoryModel(static_gb=8.0, mb_per_token=2.0)
    assert m.peak_gb(1000) == pytest.approx(10.0) and m.tokens_fitting(10.0) == 1000 and m.tokens_fitting(7) == 0


def test_a_summary_refuses_wrong_types_even_on_assignment():
    s = RunSummary()
    s.outcome = "skipped"
    assert s.outcome is Outcome.skipped
    with pytest.raises(ValueError):
        s.outcome = "fine"
    with pytest.raises(ValueError):
        s.trained_samples = "many"


def test_exit_codes_and_version_names():
    assert outcome_exit_code(Outcome.failed) == ExitCode.FAILED == 1
    assert outcome_exit_code(Outcome.interrupted) == ExitCode.INTERRUPTED == 3
    assert outcome_exit_code(Outcome.rejected) == outcome_exit_code(Outcome.skipped) == ExitCode.OK
    assert version_name("tiny", 7) == "tiny-v0007" and parse_version_name("my-model-v12345") == ("my-model", 12345)
    assert parse_version_name("tiny-v7") is None and parse_version_name("base") is None
