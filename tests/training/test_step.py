"""The training step's bookkeeping on the CPU: the loss it reports (whole batch and OOM halves) and the weights it
clips (the optimizer's, not a scan of the model's parameters every step)."""

from __future__ import annotations

import pytest
import torch

from jobs.training.step import make_optimizer, model_inputs, train_step


def _setup(tiny_model):
    from jobs.contract import StepShape
    from jobs.training.config import TrainConfig
    from jobs.training.fp8.numerics import bigram_samples
    from jobs.training.load import load_for_training
    from jobs.training.packing import packed_batches

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=256, gradient_checkpointing=False)
    loaded = load_for_training(tiny_model, cfg, adapter=None,
                               shape=StepShape(tokens_per_step=512, gradient_checkpointing=False, basis="test"))
    batch = next(packed_batches(bigram_samples(len(loaded.tokenizer), 400, seed=3), tokens_per_step=512))
    return loaded.model, batch


def _loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(**model_inputs(batch, "cpu")).loss)


@pytest.mark.parametrize("halve", [False, True])
def test_the_step_reports_the_batch_loss_before_its_update_whole_or_in_halves(tiny_model, halve):
    model, batch = _setup(tiny_model)
    assert len(batch.sample_ids) > 1
    want = _loss(model, batch)
    st = train_step(model, batch, make_optimizer(model, lr=1e-2), device="cpu", halve=halve)
    assert isinstance(st.loss, float) and st.split == halve
    assert st.loss == pytest.approx(want, rel=0.02 if halve else 1e-5)  # halves: token-weighted means of two rows
    assert _loss(model, batch) < want  # the update happened after the loss was taken


def test_clipping_goes_through_the_optimizers_weights(tiny_model, monkeypatch):
    model, batch = _setup(tiny_model)
    opt = make_optimizer(model, lr=1e-3)
    seen: list[int] = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda ps, n: seen.append(len(list(ps))) or real(ps, n))
    monkeypatch.setattr(type(model), "parameters", lambda *a, **k: pytest.fail("the step scanned the model"))
    train_step(model, batch, opt, device="cpu")
    assert seen == [sum(len(g["params"]) for g in opt.param_groups)]
