"""Calibrate's timed window starts only once steps take a settled time per token (CPU, a fake step)."""

from __future__ import annotations

import pytest

from jobs.training import probe
from jobs.training.models.synthetic import make_samples
from jobs.training.step import StepStat


def _run(monkeypatch: pytest.MonkeyPatch, per_token: list[float], clock=None,
         **kw) -> tuple[probe.Throughput, list[int]]:
    calls: list[int] = []

    def fake_step(model, batch, optimizer):
        i = len(calls)
        calls.append(batch.real_tokens)
        seconds = per_token[min(i, len(per_token) - 1)] * batch.real_tokens
        if clock is not None:
            clock.now += seconds
        return StepStat(tokens=batch.real_tokens, seconds=seconds, loss=1.0)

    monkeypatch.setattr(probe, "train_step", fake_step)
    samples = make_samples("alpaca", 40 * 1024, vocab=1000, seed=1)
    return probe.timed_steps(None, samples, 1024, None, seconds=60.0, max_steps=5, **kw), calls


def test_warm_up_lasts_until_steps_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = [5.0, 3.0, 2.0, 1.5, 1.2, 1.0, 1.0, 1.0]  # compiling, autotuning: steps 1-6 still speeding up
    got, calls = _run(monkeypatch, slow)
    assert got.steps == 5
    assert len(calls) == 7 + 5  # 7 warm-up steps: the 7th is the first within 5 % of the one before
    assert got.tokens == sum(calls[7:])


def test_steady_steps_warm_up_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    got, calls = _run(monkeypatch, [1.0])
    assert len(calls) == 3 + 5 and got.steps == 5


def test_warm_up_never_outlasts_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    never = [1.0 / (i + 1) for i in range(40)]  # always 2x faster than the step before
    _, calls = _run(monkeypatch, never, max_warmup=6)
    assert len(calls) == 6 + 5


def test_warm_up_lasts_its_seconds_even_once_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    # calibrate's first profile: a window right after two steps in a row agreed read 4 % under one after 30 s
    # of steps, and the night planned from it ran 9.0 % under its plan instead of 4.6 %
    # (RESULTS.md: 2026-11-26, calibrate warm-up)
    monkeypatch.setattr(probe.time, "perf_counter", _clock := _FakeClock())
    _, calls = _run(monkeypatch, [0.001], clock=_clock, warmup_seconds=5.0, max_warmup=3)
    warm = len(calls) - 5
    assert sum(calls[:warm]) * 0.001 >= 5.0 > sum(calls[:warm - 1]) * 0.001  # just past 5 s, then timed
    assert warm > 3  # the step minimum and the cap give way to the seconds


def test_a_one_off_stall_in_the_window_is_left_out_of_the_rate_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # the H200 calibrate run: settled at once, then one step 5x slower (RESULTS.md: 2026-11-23, calibrate step stalls)
    monkeypatch.setattr(probe.time, "perf_counter", _clock := _FakeClock())
    per_token = [0.001, 0.001, 0.001, 0.001, 0.005, 0.001, 0.001, 0.001, 0.001]  # 1 ms per token
    got, calls = _run(monkeypatch, per_token, clock=_clock)
    assert got.steps == 5 and got.stalls == 1
    assert got.stall_seconds == pytest.approx(0.004 * calls[4], abs=1e-3)
    assert got.tokens_per_second == pytest.approx(1000.0, rel=1e-3)  # the steady rate, not 1000 x 5/9


def test_steady_variation_is_not_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe.time, "perf_counter", _clock := _FakeClock())
    got, _ = _run(monkeypatch, [0.001, 0.001, 0.001, 0.001, 0.0015, 0.0009, 0.0011, 0.0016, 0.001],
                  clock=_clock)
    assert got.stalls == 0 and got.stall_seconds == 0.0


class _FakeClock:
    """perf_counter advanced by the fake steps' seconds: the window's wall time is theirs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_synthetic_samples_can_leave_a_prompt_share_untrained():
    """The benchmark's `--prompt-share`: a night's prompts are not trained on, calibrate's samples are."""
    from jobs.data.batching import IGNORE_INDEX

    whole = make_samples("alpaca", 5000, vocab=300)
    half = make_samples("alpaca", 5000, vocab=300, prompt_share=0.5)
    assert [s.input_ids for s in whole] == [s.input_ids for s in half]
    assert all(s.labels == s.input_ids for s in whole)
    for s in half:
        k = min(s.n_tokens - 1, int(s.n_tokens * 0.5))
        assert s.labels[:k] == [IGNORE_INDEX] * k and s.labels[k:] == s.input_ids[k:] and s.labels[-1] != IGNORE_INDEX


def test_without_a_step_cap_the_window_lasts_its_seconds_reusing_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate's `--seconds 60` timed 30 steps (~15 s on an H200): with max_steps=None the window is
    the seconds asked for, the samples' rows taken again from the first once they run out."""
    monkeypatch.setattr(probe.time, "perf_counter", _clock := _FakeClock())
    calls: list[int] = []

    def fake_step(model, batch, optimizer):
        calls.append(batch.real_tokens)
        _clock.now += 0.001 * batch.real_tokens  # ~1 s a step
        return StepStat(tokens=batch.real_tokens, seconds=0.001 * batch.real_tokens, loss=1.0)

    monkeypatch.setattr(probe, "train_step", fake_step)
    samples = make_samples("alpaca", 10 * 1024, vocab=1000, seed=1)  # ~10 rows of 1,024 tokens
    got = probe.timed_steps(None, samples, 1024, None, seconds=60.0, max_steps=None)
    assert 55 <= got.seconds <= 62 and got.steps > 50  # far more steps than the rows
    assert got.tokens_per_second == pytest.approx(1000.0, rel=1e-3)
    with pytest.raises(ValueError, match="not one step"):
        probe.timed_steps(None, [], 1024, None, seconds=1.0)


def test_the_window_ends_after_the_gpu_has_run_its_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """train_step returns while the GPU still runs the step's backward (jobs/training/step.py): the window's wall
    time is read after a synchronise that follows its last step, not at that step's return."""
    events: list[str] = []
    monkeypatch.setattr(probe, "_synchronize", lambda torch: events.append("sync"))
    real = probe.time.perf_counter
    monkeypatch.setattr(probe.time, "perf_counter", lambda: events.append("clock") or real())
    got, _ = _run(monkeypatch, [1.0])
    assert got.steps == 5 and events[-2:] == ["sync", "clock"]
