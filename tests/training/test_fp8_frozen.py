"""FP8 for frozen projections no LoRA layer wraps (issue 16): under a q,v adapter (the Exxact recipe's)
k, o and the MLP are ~90 % of an 8B's projection FLOPs, and they are frozen too. CPU, emulated matmuls."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from jobs.contract import StepShape
from jobs.training.fp8.convert import Conversion, find_units
from jobs.training.fp8.matmul import STATS, FP8Base, rel_error

SHAPE = StepShape(tokens_per_step=256, gradient_checkpointing=False, basis="test")
QV = ["q_proj", "v_proj"]


def _load(path: Path, targets: list[str] | str = QV):
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=128, gradient_checkpointing=False,
                      target_modules=targets)
    return load_for_training(path, cfg, adapter=None, shape=SHAPE)


def _batch(loaded):
    from jobs.training.fp8.numerics import bigram_samples
    from jobs.training.packing import packed_batches

    return next(packed_batches(bigram_samples(len(loaded.tokenizer), 300), tokens_per_step=256))


def _loss(model, batch) -> float:
    from jobs.training.step import model_inputs

    with torch.no_grad():
        return float(model(**model_inputs(batch, "cpu")).loss)


def test_a_q_v_adapter_runs_every_frozen_projection_on_fp8_and_still_trains_and_saves(tiny_model, tmp_path):
    from peft import get_peft_model_state_dict

    from jobs.training.fp8.enable import CAPTURE_TOKENS, enable_fp8
    from jobs.training.fp8.sample_data import data_files, sample_tokens
    from jobs.training.step import make_optimizer, train_step

    loaded = _load(tiny_model)
    model = loaded.model
    keys = set(get_peft_model_state_dict(model))
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    batch = _batch(loaded)
    before = _loss(model, batch)
    ids, source = sample_tokens(loaded.tokenizer, data_files(None, []), n=CAPTURE_TOKENS)
    out = enable_fp8(model, device="cpu", tokens=ids, activations=source, unsloth=False, source_dir=tiny_model)
    n = out.numerics
    assert out.compute == "fp8" and out.error is None and n is not None and n.passed
    # 4 layers x 7 projections: q and v under LoRA, k, o, gate, up, down without it; each measured
    assert n.layers == n.converted == sum(isinstance(m, FP8Base) for m in model.modules()) == 28
    assert set(n.by_projection) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(x.fp8 is not None and x.fp8 < 0.08 and x.fp8_dgrad < 0.08 for x in out.layers)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, FP8Base) and isinstance(layer.mlp.down_proj, FP8Base)
    assert isinstance(layer.self_attn.q_proj.base_layer, FP8Base)
    assert model.get_output_embeddings() is lm_head and model.get_input_embeddings() is embed
    assert out.conversion["other_gb"] == 0 and out.conversion["fp8_gb"] > 0  # nothing frozen left in bf16
    assert abs(_loss(model, batch) - before) / before < 0.02

    opt = make_optimizer(model, lr=1e-3)
    calls = STATS.fp8_calls.get("linear", 0)
    st = train_step(model, batch, opt, device="cpu")
    assert st.loss == st.loss and STATS.fp8_calls["linear"] >= calls + 28
    assert all(p.grad is None for n_, p in model.named_parameters() if not p.requires_grad)
    assert set(get_peft_model_state_dict(model)) == keys  # the adapter is what it was: q and v only
    model.save_pretrained(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_frozen_projections_revert_to_the_very_modules_they_were(tiny_model):
    loaded = _load(tiny_model)
    model, batch = loaded.model, _batch(loaded)
    originals = {n: m for n, m in model.named_modules() if n.endswith(("k_proj", "o_proj", "up_proj"))}
    ref = _loss(model, batch)
    units = find_units(model)
    assert sorted({(u.kind, u.route) for u in units}) == [("frozen", "modules"), ("linear", "modules")]
    conv = Conversion(keep_originals=True).run(units)
    assert conv.converted == 28 and conv.fallbacks == {}
    assert abs(_loss(model, batch) - ref) > 0.0
    assert conv.revert() == 28
    assert {n: m for n, m in model.named_modules() if n.endswith(("k_proj", "o_proj", "up_proj"))} == originals
    assert _loss(model, batch) == ref  # exactly the bf16 model again


def test_only_frozen_projections_are_taken_and_a_foreign_fused_function_keeps_its_modules():
    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(64, 64, bias=True), torch.nn.Linear(64, 32)
            self.v_proj, self.o_proj = torch.nn.Linear(64, 32), torch.nn.Linear(64, 64)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attn()
            self.gate = torch.nn.Linear(64, 16)  # a MoE router: not a projection by name
            self.lm_head = torch.nn.Linear(64, 128)
            self.down_proj = torch.nn.Linear(64, 64)  # trainable (a full fine-tune's): never converted

    block = Block()
    for m in (block.self_attn, block.gate, block.lm_head):
        m.requires_grad_(False)
    units = find_units(block)
    assert sorted(n for u in units for n, _ in u.projs.values()) == [
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    block.self_attn.apply_o = types.MethodType(lambda self, x: x @ self.o_proj.weight.t(), block.self_attn)
    conv = Conversion().run(find_units(block))
    assert conv.converted == 3 and isinstance(block.self_attn.q_proj, FP8Base)
    assert type(block.self_attn.o_proj) is torch.nn.Linear  # read by a function we did not write
    assert [(x.name, x.fallback) for x in conv.layers if not x.converted] == [
        ("self_attn.o_proj", "apply_o is tests.training.test_fp8_frozen.<lambda> (not patched)")]
    x = torch.randn(5, 64)
    ref = x @ block.self_attn.q_proj.dequantized().t() + block.self_attn.q_proj.bias
    assert rel_error(block.self_attn.q_proj(x), ref) < 0.06  # the bias is kept
