"""The bench's timed window says whether its rate still climbed inside it (first / middle / last third)."""

from benchmarks.measure import Window


def test_thirds_show_a_rate_still_climbing() -> None:
    w = Window(warmup=1, max_steps=100, seconds=60.0)
    w.timed = [(1.0, 900, 10)] * 4 + [(1.0, 1000, 10)] * 4 + [(1.0, 1000, 10)] * 5
    assert w.thirds() == [900.0, 1000.0, 1000.0]


def test_too_few_steps_have_no_thirds() -> None:
    w = Window(warmup=1, max_steps=100, seconds=60.0)
    w.timed = [(1.0, 1000, 10)] * 5
    assert w.thirds() is None


def test_samples_per_hour_is_the_token_rate_over_the_data_sets_mean_sample() -> None:
    """Rows filled best-fit do not take the data set's mix of lengths in order: a short window's own sample
    count is not what a whole night trains an hour. The figure divides by the data set's mean instead."""
    from jobs.data.batching import TokenizedSample
    from jobs.training.packing import packed_batches

    data = [TokenizedSample(i, [1] * n, [1] * n) for i, n in enumerate(([60] * 6 + [900, 1400]) * 40)]
    w = Window(warmup=0, max_steps=3, seconds=60.0)
    w.t_start, w.t_end = 0.0, 3.0
    for b in list(packed_batches(data, tokens_per_step=2000))[:3]:
        w.timed.append((1.0, b.real_tokens, len(b.sample_ids)))
    r = w.result(data)
    assert r["real_tok_s"] == sum(t for _, t, _ in w.timed) / 3.0
    assert r["samples_per_hour"] == r["real_tok_s"] * 3600 / 332.5  # the data set's mean: 332.5 tokens
    assert r["window_samples_per_hour"] > 1.4 * r["samples_per_hour"]  # the window's own samples: 221 tokens
    assert w.result()["samples_per_hour"] == r["window_samples_per_hour"]  # no data set: the window's count
