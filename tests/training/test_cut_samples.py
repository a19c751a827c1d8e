"""Cut samples, not epochs: when time runs short the loop defers whole samples it has not reached,
so every sample it counts as trained got all its epochs; and every step's loss is kept.

A fake clock: each training step takes one "second", nothing else does.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from jobs.contract import StepShape  # noqa: E402
from jobs.data.batching import TokenizedSample  # noqa: E402
from jobs.training import step as step_module  # noqa: E402
from jobs.training.batch_sequence import plan_batches  # noqa: E402
from jobs.training.config import TrainConfig  # noqa: E402
from jobs.training.load import Loaded  # noqa: E402
from jobs.training.loop import train  # noqa: E402

CFG = TrainConfig(batching="padded", batch_size=4, max_tokens_per_batch=4096, max_seq_length=16, epochs=3,
                  warmup_steps=0)
SHAPE = StepShape(tokens_per_step=4096, gradient_checkpointing=False, basis="test")


def samples(n: int, length: int = 10) -> list[TokenizedSample]:
    return [TokenizedSample(i, [1 + (i + j) % 60 for j in range(length)], [-100] + [1 + (i + j) % 60
            for j in range(1, length)]) for i in range(n)]


def tiny() -> Loaded:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    return Loaded(model, SimpleNamespace(pad_token_id=0), "hf", "cpu", {})


class StepClock:
    """Time advances by one second per training step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 1000.0
        real = step_module.train_step

        def timed(*args, **kwargs):
            st = real(*args, **kwargs)
            self.t += 1.0
            st.seconds = 1.0
            return st

        monkeypatch.setattr(step_module, "train_step", timed)

    def __call__(self) -> float:
        return self.t


def test_when_time_runs_short_whole_samples_are_cut_and_the_rest_get_every_epoch(monkeypatch, tmp_path: Path):
    clock = StepClock(monkeypatch)
    data = samples(40)  # 10 batches an epoch, 30 steps: the deadline leaves room for 20
    res = train(tiny(), data, CFG, ckpt_root=tmp_path, deadline=clock.t + 20, stop=threading.Event(), shape=SHAPE,
                clock=clock, save_seconds=0)
    assert res.cut_ids and res.stopped is None and not res.partial_ids  # finished what it kept
    assert sorted(res.trained_ids + res.cut_ids) == list(range(40))
    assert res.cut_ids == sorted(res.cut_ids)[::-1] and min(res.cut_ids) > max(res.trained_ids)  # from the tail
    batches = plan_batches(data, CFG, 0, 4096, cuts=[(at, ids) for at, ids in res.detail.cuts])
    seen = Counter(sid for b in batches[: res.steps] for sid in b.sample_ids)
    assert {seen[sid] for sid in res.trained_ids} == {3} and not set(seen) & set(res.cut_ids)  # 3 epochs, or none
    assert res.steps <= 20 and [s for s, _ in res.loss_curve] == list(range(1, res.steps + 1))
    assert all(loss > 0 for _, loss in res.loss_curve)


def test_a_stop_in_a_later_epoch_leaves_its_unfinished_samples_untrained(monkeypatch, tmp_path: Path):
    clock = StepClock(monkeypatch)
    stop = threading.Event()
    real = step_module.train_step

    def stop_after_15(*args, **kwargs):
        st = real(*args, **kwargs)
        if clock.t >= 1015:
            stop.set()
        return st

    monkeypatch.setattr(step_module, "train_step", stop_after_15)
    res = train(tiny(), samples(40), CFG, ckpt_root=tmp_path, deadline=clock.t + 1e6, stop=stop, shape=SHAPE,
                clock=clock, save_seconds=0)
    assert res.stopped == "signal" and res.steps == 15 and not res.cut_ids
    assert res.trained_ids == [] and len(res.partial_ids) == 40  # all in epoch 2: none finished its epochs


def test_a_cut_keeps_the_batches_already_trained():
    data = samples(40)
    whole = plan_batches(data, CFG, 0, 4096)
    cut = plan_batches(data, CFG, 0, 4096, cuts=[(3, [39, 38, 37, 36, 35])])
    assert [b.sample_ids for b in cut[:3]] == [b.sample_ids for b in whole[:3]]
    counts = Counter(sid for b in cut for sid in b.sample_ids)
    assert all(counts[i] == 3 for i in range(35)) and not any(counts[i] for i in range(35, 40))
    assert plan_batches(data, CFG, 0, 4096, cuts=[]) == whole


class ScriptedClock(StepClock):
    """Each step takes `seconds(n)` for the n-th step of the run (from 0)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: Callable[[int], float]) -> None:
        self.t, self.n = 1000.0, 0
        real = step_module.train_step

        def timed(*args, **kwargs):
            st = real(*args, **kwargs)
            dt = seconds(self.n)
            self.n += 1
            self.t += dt
            st.seconds = dt
            return st

        monkeypatch.setattr(step_module, "train_step", timed)


def warm_clock(monkeypatch: pytest.MonkeyPatch, first: float, slow_at: int | None = None,
              slow: float = 0.0) -> ScriptedClock:
    """One second per step, except the attempt's first step (a compile): `first` seconds; and `slow` at
    step index `slow_at`."""
    return ScriptedClock(monkeypatch, lambda n: first if n == 0 else slow if n == slow_at else 1.0)


def test_the_first_step_of_an_attempt_is_warm_up_not_the_rate_a_cut_is_sized_by(monkeypatch, tmp_path: Path):
    """30 one-second steps and a 10-second compile in the first fit a 42-second deadline: nothing may be
    cut (counting the compile in the rate would have cut a third of the samples)."""
    clock = warm_clock(monkeypatch, first=10.0)
    res = train(tiny(), samples(40), CFG, ckpt_root=tmp_path, deadline=clock.t + 42, stop=threading.Event(),
                shape=SHAPE, clock=clock, save_seconds=0)
    assert not res.cut_ids and res.stopped is None and res.steps == 30
    assert res.warmup_seconds == 10.0 and res.warmup_tokens == 40  # the first batch: 4 samples x 10 tokens
    assert res.tokens == 1200 and res.seconds == pytest.approx(39.0)


def test_a_step_far_slower_than_the_others_is_noted_with_its_typical_time(monkeypatch, tmp_path: Path):
    import structlog

    clock = warm_clock(monkeypatch, first=1.0, slow_at=6, slow=9.0)
    with structlog.testing.capture_logs() as logged:
        res = train(tiny(), samples(40), CFG, ckpt_root=tmp_path, deadline=clock.t + 1e6, stop=threading.Event(),
                    shape=SHAPE, clock=clock, save_seconds=0)
    assert res.detail.slow_steps == [(7, 9.0, 1.0)]  # optimizer step 7 took 9 s where 1 s was typical
    # noted, not warned: 21 slow_step warnings in a 66-step night on a busy box gave an operator nothing to do
    assert [x["log_level"] for x in logged if x["event"] == "slow_step"] == ["info"]


def test_periodic_checkpoint_saves_are_counted_and_timed_apart(monkeypatch, tmp_path: Path):
    """Each save takes half a "second" of the fake clock: the result counts the saves and their seconds
    (the night records its rate without them, the plan adds them per save)."""
    import jobs.training.loop as loop

    clock = StepClock(monkeypatch)
    real_save = loop.save_checkpoint

    def slow_save(*args, **kwargs):
        real_save(*args, **kwargs)
        clock.t += 0.5

    monkeypatch.setattr(loop, "save_checkpoint", slow_save)
    cfg = CFG.model_copy(update={"checkpoint_every_seconds": 2.0, "epochs": 1})
    stop = threading.Event()
    res = train(tiny(), samples(40), cfg, ckpt_root=tmp_path, deadline=clock.t + 1000, stop=stop, shape=SHAPE,
                clock=clock, save_seconds=0)
    assert res.steps == 10 and res.checkpoints == 4  # after steps 2, 4, 6, 8 (not after the last)
    assert res.checkpoint_seconds == pytest.approx(4 * 0.5)
    assert res.seconds == pytest.approx(10 + 4 * 0.5, abs=0.6)  # training time holds the saves


def test_one_epoch_is_never_cut_the_deadline_leaves_the_rest_pending(monkeypatch, tmp_path: Path):
    """With one epoch a cut defers nothing the deadline's stop would not (and repacks the rest for it)."""
    clock = StepClock(monkeypatch)
    cfg = CFG.model_copy(update={"epochs": 1})
    res = train(tiny(), samples(80), cfg, ckpt_root=tmp_path, deadline=clock.t + 8, stop=threading.Event(),
                shape=SHAPE, clock=clock, save_seconds=0)
    assert res.stopped == "deadline" and not res.cut_ids and not res.partial_ids
    assert res.trained_ids == list(range(4 * res.steps)) and res.steps < 20  # the rest: untouched, pending


def test_repacking_after_a_cut_is_not_training_time_so_a_cut_does_not_cascade(monkeypatch, tmp_path: Path):
    """A cut repacks the samples not reached (seconds for tens of thousands of samples): the rate the next
    cut is sized by leaves that time out. Counted in, each cut lowered the measured rate, which cut again
    at the next step: a night on 2 H200s cut 49 times and trained 17 % of its plan."""
    from jobs.training import loop

    clock = StepClock(monkeypatch)
    real = loop.cut_first

    def slow_repack(*args, **kwargs):
        clock.t += 0.5  # 60,000 samples took ~0.25 s to repack on the GPU host, its steps 0.26 s
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "cut_first", slow_repack)
    res = train(tiny(), samples(40), CFG, ckpt_root=tmp_path, deadline=clock.t + 24, stop=threading.Event(),
                shape=SHAPE, clock=clock, save_seconds=0)
    cuts = res.detail.cuts  # the first, and at most a sample or two for the half second its repacking really took
    assert len(cuts) <= 2 and sum(len(ids) for _, ids in cuts[1:]) <= 2, cuts
    assert len(res.cut_ids) <= 12 and len(res.trained_ids) >= 24  # about what 24 one-second steps hold


def test_the_steps_before_an_attempts_rate_settles_are_counted_apart(monkeypatch, tmp_path: Path):
    clock = ScriptedClock(monkeypatch, lambda n: max(1.0, 2.0 - 0.2 * n))  # settling to 1 s (a cold cache)
    res = train(tiny(), samples(80), CFG, ckpt_root=tmp_path, deadline=clock.t + 1e6, stop=threading.Event(),
                shape=SHAPE, clock=clock, save_seconds=0)
    assert res.steps == 60 and res.warmup_seconds == 2.0  # the first step: warm-up, whole
    # steps 2-4 beyond the settled 1 s: from the 5th, 8 steps in a row are within 3 % of it on average
    assert res.ramp_seconds == pytest.approx(0.8 + 0.6 + 0.4)
