"""A night without a measurement sizes its steps from two short probe steps, not the whole budget."""

import threading

from jobs.contract import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training import step as step_mod
from jobs.training.batch_sequence import PROBE_TOKENS, plan_batches, probe_sizes
from jobs.training.config import TrainConfig
from jobs.training.loop import STEPS_IN_TIME_LEFT, train


def samples(n: int, length: int = 40) -> list[TokenizedSample]:
    return [TokenizedSample(i, [5 + (i + j) % 50 for j in range(length)], [-100] + [7] * (length - 1))
            for i in range(n)]


def test_probe_batches_open_the_first_epoch_and_are_rebuilt_identically():
    cfg = TrainConfig(batching="packed", epochs=2)
    xs = samples(50)
    sizes = probe_sizes(xs)
    assert sizes == [PROBE_TOKENS // 40, PROBE_TOKENS // 40]
    a = plan_batches(xs, cfg, 0, 400, sizes)
    assert [len(b.sample_ids) for b in a[:2]] == sizes and a[0].sample_ids == list(range(sizes[0]))
    assert [b.sample_ids for b in a] == [b.sample_ids for b in plan_batches(xs, cfg, 0, 400, sizes)]
    assert sum(len(b.sample_ids) for b in a) == 100  # every sample once per epoch


def test_a_slow_model_with_a_wrong_prior_takes_steps_that_fit_the_time_left(tiny_model, tmp_path, monkeypatch):
    """Each token costs 1 ms here: one configured 16,384-token step would take 16 s of a 3 s budget. The cost
    is the loop's own measure of a step and its injected clock advances by it, so a busy machine (a 240-token
    probe took 7.7 s of real time at load 15 and left no room for a third step) changes nothing."""
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", batching="packed", max_seq_length=128, lora_rank=4)
    shape = StepShape(tokens_per_step=16384, gradient_checkpointing=False, basis="test")
    loaded = load_for_training(tiny_model, cfg, adapter=None, shape=shape)
    real_step = step_mod.train_step
    seen: list[tuple[int, float]] = []
    now = [1_000.0]  # the loop's clock: seconds of simulated work

    def slow_step(model, batch, optimizer, **kw):
        st = real_step(model, batch, optimizer, **kw)
        st.seconds = batch.real_tokens * 1e-3
        now[0] += st.seconds
        seen.append((batch.real_tokens, st.seconds))
        return st

    monkeypatch.setattr(step_mod, "train_step", slow_step)
    budget = 3.0
    deadline = now[0] + budget
    res = train(loaded, samples(150), cfg, ckpt_root=tmp_path / "ck", deadline=deadline, stop=threading.Event(),
                shape=shape, save_seconds=0.5, probe_first=True, clock=lambda: now[0])
    assert now[0] <= deadline - 0.5  # no step ran into the time kept to save
    # stopped by the deadline, or finished in time after cutting whole samples that would not fit
    assert (res.stopped == "deadline" or res.cut_ids) and res.steps >= 3
    assert res.detail.probe_samples == probe_sizes(samples(150))
    assert res.detail.tokens_per_step <= budget / STEPS_IN_TIME_LEFT / 1e-3  # 1/20 of the time left at most
    assert max(s for _, s in seen[1:]) < budget / 3  # after the first (warm-up) probe, no step near the budget
