"""The bench's timed window says whether its rate still climbed inside it (first / middle / last third)."""

from jobs.bench.measure import Window


def test_thirds_show_a_rate_still_climbing() -> None:
    w = Window(warmup=1, max_steps=100, seconds=60.0)
    w.timed = [(1.0, 900, 10)] * 4 + [(1.0, 1000, 10)] * 4 + [(1.0, 1000, 10)] * 5
    assert w.thirds() == [900.0, 1000.0, 1000.0]


def test_too_few_steps_have_no_thirds() -> None:
    w = Window(warmup=1, max_steps=100, seconds=60.0)
    w.timed = [(1.0, 1000, 10)] * 5
    assert w.thirds() is None
