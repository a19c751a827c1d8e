"""The base stays resident between a night's adapters (jobs/training/resident.py): the next adapter's LoRA goes
on the very base object the last one trained on, that base's weights are the ones loaded (nothing of the last
LoRA merged or left behind), and nothing is held unless a night of several adapters asks for it."""

import pytest
import torch

from jobs.contract import StepShape
from jobs.training import resident
from jobs.training.config import TrainConfig
from jobs.training.load import load_for_training

SHAPE = StepShape(tokens_per_step=512, gradient_checkpointing=False, basis="test")


def _base_weights(model) -> dict[str, torch.Tensor]:
    """The base's own weights, by their name in the bare model (PEFT's `base_layer.` and prefixes left out)."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        out[name.replace("base_model.model.", "").replace(".base_layer", "")] = p.detach().clone()
    return out


def test_the_next_adapter_goes_on_the_same_base_with_its_weights_untouched(tiny_model):
    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=64, gradient_checkpointing=False)
    fresh = _base_weights(load_for_training(tiny_model, cfg, adapter=None, shape=SHAPE).model)
    resident.enable()
    try:
        first = load_for_training(tiny_model, cfg, adapter=None, shape=SHAPE)
        assert first.info["base_reused"] is False
        with torch.no_grad():  # the first adapter "trains": its LoRA moves away from zero
            for name, p in first.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.5)
        base_object = first.model.get_base_model()
        lora_modules = sum(1 for n, _ in first.model.named_modules() if n.endswith("lora_A"))
        second = load_for_training(tiny_model, cfg.model_copy(update={"lora_rank": 8}), adapter=None, shape=SHAPE)
        assert second.info["base_reused"] is True and second.model.get_base_model() is base_object  # not reloaded
        assert sum(1 for n, _ in second.model.named_modules() if n.endswith("lora_A")) == lora_modules  # one LoRA
        got = _base_weights(second.model)
        assert got.keys() == fresh.keys() and all(torch.equal(got[k], fresh[k]) for k in fresh)  # nothing merged
        ids = torch.tensor([[1, 5, 9, 13, 17]])
        with torch.no_grad(), second.model.disable_adapter():  # and it answers as the base does
            bare = second.model(input_ids=ids).logits
        with torch.no_grad():
            assert torch.allclose(second.model(input_ids=ids).logits, bare)  # a new LoRA starts at zero
    finally:
        resident.enable(False)
    third = load_for_training(tiny_model, cfg, adapter=None, shape=SHAPE)
    assert third.info["base_reused"] is False  # off: nothing held


# ---- the same LoRA shape: the held PEFT model's LoRA restarted in place, FP8's patch kept --------------------

def _samples(offset: int, n: int = 8, length: int = 12):
    from jobs.data.batching import TokenizedSample

    return [TokenizedSample(i, ids := [1 + (offset + 7 * i + 3 * j) % 500 for j in range(length)], [-100, *ids[1:]])
            for i in range(n)]


def _train(loaded, data, cfg, root):
    import threading
    import time

    from jobs.training.loop import train

    return train(loaded, data, cfg, ckpt_root=root, deadline=time.time() + 3600, stop=threading.Event(), shape=SHAPE)


def _lora(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("compute", "dropout", "in_backward"), [("bf16", 0.1, True), ("fp8", 0.0, False)])
def test_the_next_adapter_of_the_same_shape_trains_bit_for_bit_as_on_a_fresh_load(tiny_model, tmp_path, monkeypatch,
                                                                                 compute, dropout, in_backward):
    """A held model of the same LoRA shape is not loaded, patched or given a new LoRA: its LoRA is set in place to
    the fresh draw (or the parent's weights), and the adapter trained on it is bit for bit the one trained on a
    freshly loaded base, fresh or continuing a parent (night 2 of an adapter), with FP8 compute too (emulated on
    the CPU, enable_for_run once) and with lora dropout (the training's draws) and an optimizer stepping in the
    backward (its hooks on the LoRA's parameters) left by the adapter before."""
    from jobs.training.fp8 import enable

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, lora_dropout=dropout, max_seq_length=64, seed=7,
                      gradient_checkpointing=False, batching="padded", batch_size=4, epochs=1, warmup_steps=0,
                      optimizer_in_backward=in_backward, learning_rate=1e-2)
    shape = SHAPE.model_copy(update={"compute": compute})
    patched = []
    real = enable.enable_for_run
    monkeypatch.setattr(enable, "enable_for_run", lambda *a, **k: patched.append(1) or real(*a, **k))

    def load(adapter=None):
        return load_for_training(tiny_model, cfg, adapter=adapter, shape=shape)

    # references, each on a freshly loaded base: a parent adapter, a fresh adapter trained on B, the parent trained on B
    parent = load()
    _train(parent, _samples(100), cfg, tmp_path / "p")
    parent.model.save_pretrained(str(tmp_path / "parent"))
    fresh_base = _base_weights(parent.model)
    ref_fresh = load()
    init_fresh = _lora(ref_fresh.model)
    _train(ref_fresh, _samples(200), cfg, tmp_path / "rf")
    ref_child = load(tmp_path / "parent")
    _train(ref_child, _samples(200), cfg, tmp_path / "rc")
    patched.clear()

    resident.enable()
    try:
        first = load()
        _train(first, _samples(300), cfg, tmp_path / "a")  # another adapter's night: its LoRA, optimizer, draws
        assert first.info["base_reused"] is False
        second = load()
        assert second.info["base_reused"] is True and second.model is first.model  # the PEFT model itself
        assert all(p.grad is None for p in second.model.parameters())
        assert _equal(_lora(second.model), init_fresh)  # the very draw of a fresh load
        _train(second, _samples(200), cfg, tmp_path / "b")
        trained_second = _lora(second.model)
        assert _equal(trained_second, _lora(ref_fresh.model))
        third = load(tmp_path / "parent")  # night 2 of an adapter: continuing its current version
        assert third.info["base_reused"] is True and third.model is first.model
        _train(third, _samples(200), cfg, tmp_path / "c")
        assert _equal(_lora(third.model), _lora(ref_child.model))
        assert not _equal(_lora(third.model), trained_second)  # (the two adapters did differ)
        assert len(patched) == (1 if compute == "fp8" else 0)  # FP8 patched the base once: at its load
        if compute == "fp8":
            assert third.info["fp8"]["reused_base"] is True and third.info["fp8"]["compute"] == "fp8"
        else:
            got = _base_weights(third.model)  # the base's weights are the ones loaded
            assert got.keys() == fresh_base.keys() and all(torch.equal(got[k], fresh_base[k]) for k in fresh_base)
    finally:
        resident.enable(False)


def test_an_fp8_patched_base_is_loaded_again_for_another_lora_shape(tiny_model):
    shape = SHAPE.model_copy(update={"compute": "fp8"})
    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=64, gradient_checkpointing=False)
    resident.enable()
    try:
        first = load_for_training(tiny_model, cfg, adapter=None, shape=shape)
        second = load_for_training(tiny_model, cfg.model_copy(update={"lora_rank": 8}), adapter=None, shape=shape)
        assert second.info["base_reused"] is False and second.model is not first.model
        third = load_for_training(tiny_model, cfg.model_copy(update={"lora_rank": 8, "seed": 1}), adapter=None,
                                  shape=shape)
        assert third.info["base_reused"] is False  # another seed: another fresh draw than the one kept
    finally:
        resident.enable(False)
