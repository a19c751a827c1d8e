"""On CUDA: memory disappears mid-night (an inference server grows) and the out-of-memory halving keeps
the night alive. Not a stand-in: a real torch.OutOfMemoryError from the caching allocator.

python -m pytest tests/training/test_gpu_oom.py -q -m gpu
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
from tests.training.conftest import random_samples  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = 16384


def extra_peak(model, batch, optimizer) -> int:
    """Bytes a step needs above what is allocated before it."""
    from jobs.training.step import train_step

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, batch, optimizer)
    return torch.cuda.max_memory_allocated() - base


def test_memory_taken_mid_night_is_survived_by_halving(tmp_path):
    from jobs.contract import StepShape
    from jobs.training.batch_sequence import plan_batches
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training
    from jobs.training.loop import train
    from jobs.training.models.architectures import build_random_model
    from jobs.training.packing import split_in_two
    from jobs.training.step import make_optimizer

    path = build_random_model("small-llama", tmp_path / "small-llama")
    cfg = TrainConfig(backend="hf", method="lora", batching="packed", tokens_per_step=TOKENS,
                      max_seq_length=512, gradient_checkpointing=False, warmup_steps=0, lora_rank=16)
    shape = StepShape(tokens_per_step=TOKENS, gradient_checkpointing=False, basis="test")
    loaded = load_for_training(path, cfg, adapter=None, shape=shape)
    data = random_samples(260, vocab=32000, lengths=(200, 400))
    batches = plan_batches(data, cfg, loaded.tokenizer.pad_token_id, TOKENS)
    assert len(batches) >= 4 and len(batches[1].sample_ids) > 1
    # what a full step and a half step need on this card (measured, not guessed)
    opt = make_optimizer(loaded.model)
    extra_peak(loaded.model, batches[0], opt)  # warm-up: optimizer state, kernels
    full = extra_peak(loaded.model, batches[1], opt)
    half = max(extra_peak(loaded.model, h, opt) for h in split_in_two(batches[1]))
    assert half < 0.8 * full, (half, full)
    del opt
    keep = (full + half) // 2  # room for a half step, not for a whole one
    blocker: list[object] = []
    events = []

    def emit(ev):  # after the first step of the night: "the server grows" into everything but `keep`
        events.append(ev)
        if ev.event == "progress" and not blocker:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            blocker.append(torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda"))
            torch.cuda.empty_cache()

    try:
        res = train(loaded, data, cfg, ckpt_root=tmp_path / "ckpt", deadline=time.time() + 600,
                    stop=threading.Event(), shape=shape, emit=emit)
    finally:  # the card goes back to the tests after this one, whatever happened
        taken = bool(blocker)
        blocker.clear()
        torch.cuda.empty_cache()
    assert taken, "the memory was never taken"
    assert [e.event for e in events].count("oom_split") == 1  # one real OOM, then halves up front
    assert res.detail.halved and res.stopped is None
    assert res.steps == len(batches) and len(res.trained_ids) == len(data)  # the night went on to the end
    assert res.mean_loss is not None and res.mean_loss == res.mean_loss  # finite
