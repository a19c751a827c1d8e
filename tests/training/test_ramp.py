"""A night's recorded rate is its settled rate: steps that ran slower at an attempt's start (the H200's
first night in a new state directory: ~10k tok/s, then ~16.4k after ~31 s) are overhead, not the rate."""

from __future__ import annotations

import pytest

from jobs.training.loop import RAMP_WINDOW, ramp_excess


def _steps(per_token: list[float], tokens: int = 8192) -> list[tuple[int, float]]:
    return [(tokens, p * tokens) for p in per_token]


def test_the_steps_before_the_rate_settles_count_only_their_excess():
    settled = 1 / 16_500
    ramp = [settled * f for f in (1.65, 1.5, 1.4, 1.3, 1.2, 1.12, 1.08, 1.05)]
    steps = _steps(ramp + [settled] * 200)
    excess = ramp_excess(steps)
    assert excess == pytest.approx(sum((p - settled) * 8192 for p in ramp[:6]), rel=1e-6)  # within 3 % from the 7th
    tokens, seconds = sum(t for t, _ in steps), sum(s for _, s in steps)
    assert tokens / seconds < 16_350 and 16_450 < tokens / (seconds - excess) <= 16_500


def test_a_steady_attempt_has_no_ramp_and_a_later_stall_is_not_one():
    steady = [1 / 16_500] * 100
    assert ramp_excess(_steps(steady)) == 0.0
    stalled = list(steady)
    stalled[60] *= 5  # a recompile mid-night: the slow-step log's business, not the warm-up
    assert ramp_excess(_steps(stalled)) == 0.0


def test_too_few_steps_to_judge_by_leave_the_rate_as_measured():
    assert ramp_excess(_steps([2.0] + [1.0] * (4 * RAMP_WINDOW - 2))) == 0.0
    assert ramp_excess([]) == 0.0


def test_a_slower_first_stretch_longer_than_a_ramp_is_the_datas_not_warm_up():
    """Longer samples first (a replay pool of long records): minutes 5 % slower, then faster. Left in the
    rate: only the first RAMP_MAX_SECONDS can be a ramp."""
    settled = 1 / 16_500
    steps = _steps([settled * 1.05] * 400 + [settled] * 600)  # ~200 s slower, 0.5 s a step
    assert ramp_excess(steps) == 0.0
