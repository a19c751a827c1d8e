"""The base stays resident between a night's adapters (jobs/training/resident.py): the next adapter's LoRA goes
on the very base object the last one trained on, that base's weights are the ones loaded (nothing of the last
LoRA merged or left behind), and nothing is held unless a night of several adapters asks for it."""

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
