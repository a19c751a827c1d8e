"""FP8 frozen base (issue 16) on real LoRA models, CPU (emulated scaled matmuls): conversion, per-layer
fallback, the patched fused layers against PEFT, the numerics check and calibrate's refusal."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import pytest
import torch

from jobs.contract import StepShape
from jobs.training.fp8 import unsloth_layers as fp8_unsloth
from jobs.training.fp8.compute import CardInfo
from jobs.training.fp8.convert import Conversion, find_units
from jobs.training.fp8.matmul import STATS, FP8Base

SHAPE = StepShape(tokens_per_step=256, gradient_checkpointing=False, basis="test")


def _load(path: Path):
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=128, gradient_checkpointing=False)
    return load_for_training(path, cfg, adapter=None, shape=SHAPE)


def _fp8_bases(model) -> int:
    return sum(isinstance(m, FP8Base) for m in model.modules())


def test_every_frozen_projection_converts_measured_and_the_model_still_trains_and_saves(tiny_model, tmp_path):
    from peft import get_peft_model_state_dict

    from jobs.training.fp8.enable import CAPTURE_TOKENS, enable_fp8
    from jobs.training.fp8.numerics import bigram_samples
    from jobs.training.fp8.sample_data import data_files, sample_tokens
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    loaded = _load(tiny_model)
    keys = set(get_peft_model_state_dict(loaded.model))
    ids, source = sample_tokens(loaded.tokenizer, data_files(None, []), n=CAPTURE_TOKENS)
    assert "alpaca" in source  # real sample data, tokenised by the model's tokenizer
    out = enable_fp8(loaded.model, device="cpu", tokens=ids, activations=source, unsloth=False,
                     source_dir=tiny_model)
    n = out.numerics
    assert out.compute == "fp8" and out.error is None and n is not None and n.passed
    assert n.layers == n.converted == _fp8_bases(loaded.model) == 4 * 7  # 4 layers x q,k,v,o,gate,up,down
    assert 0.005 < n.fp8_error["median"] < 0.05 and n.fp8_error["max"] < 0.08
    assert n.nf4_error["median"] > 2 * n.fp8_error["median"]  # NF4 (emulated on the bf16 source) is worse
    assert set(n.by_projection) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(x.fp8_dgrad is not None and x.fp8_dgrad < 0.08 for x in out.layers)
    assert out.conversion["fp8_gb"] > 0 and out.conversion["other_gb"] == 0 and out.patch["status"] == "native"
    # where the time before the first FP8 step goes: each phase reached, and the conversion's own parts
    assert set(out.conversion["phase_seconds"]) == {"patch", "self_test", "capture", "convert", "commit_or_revert"}
    assert set(out.conversion["convert_seconds"]) == {"dequantise", "quantise", "check"}
    assert all(v >= 0 for v in [*out.conversion["phase_seconds"].values(), *out.conversion["convert_seconds"].values()])

    opt = make_optimizer(loaded.model, lr=1e-3)
    batch = next(packed_batches(bigram_samples(len(loaded.tokenizer), 300), tokens_per_step=256))
    calls = STATS.fp8_calls.get("linear", 0)
    st = train_step(loaded.model, batch, opt, device="cpu")
    assert st.loss == st.loss and STATS.fp8_calls["linear"] >= calls + 28  # every projection ran FP8
    assert set(get_peft_model_state_dict(loaded.model)) == keys  # the adapter is what it was
    loaded.model.save_pretrained(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


class _Projections(torch.nn.Module):
    """An attention layer's projections (q 64, k and v 32, o 64 wide)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False)
        self.v_proj, self.o_proj = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 64, bias=False)


class _SwiGLU(torch.nn.Module):
    """transformers' SwiGLU MLP, its forward as LlamaMLP's."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 128, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(128, 64, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _block():
    """Unsloth's shape of a decoder layer, its fused functions bound per instance (ours, over PEFT's)."""
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = _Projections(), _SwiGLU()

    torch.manual_seed(0)
    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)  # LoRA initialised to non-zero: its gradients must flow
        elif not p.requires_grad:
            p.data.normal_(0, 0.05)
    attn, mlp = model.base_model.model.self_attn, model.base_model.model.mlp
    attn._ns_orig_apply_qkv = lambda self, x, inplace=True: _shipped(
        (self.q_proj, self.k_proj, self.v_proj), lambda: (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
    attn._ns_orig_apply_o = lambda self, x: _shipped((self.o_proj,), lambda: self.o_proj(x))
    attn.apply_qkv, attn.apply_o = fp8_unsloth.fp8_apply_qkv, fp8_unsloth.fp8_apply_o
    mlp._ns_orig_mlp = lambda x: _shipped((mlp.gate_proj, mlp.up_proj, mlp.down_proj),
                                          lambda: type(mlp).forward(mlp, x))
    mlp.forward = types.MethodType(fp8_unsloth.fp8_apply_mlp, mlp)
    return model, attn, mlp


def _shipped(projs, compute):
    """Unsloth's fused functions as shipped: they read each base's `weight` as a dense weight (get_lora_parameters),
    which an FP8Base does not hold (kept in NF4: none at all), so they must never run over one."""
    if any(isinstance(p.base_layer, FP8Base) for p in projs):
        raise AssertionError("Unsloth's function called over an FP8 base")
    return compute()


@pytest.fixture()
def fake_unsloth(monkeypatch):
    """Unsloth's plain-LoRA checks (fast_lora), answering "plain" unless told otherwise."""
    fake = types.SimpleNamespace(
        _has_multiple_active_adapters=lambda p: False, _has_active_dora_adapter=lambda p: False,
        _has_activation_fake_quantizer=lambda p: False, _active_lora_adapter=lambda p: "default",
        _lora_dropout_and_bias=lambda projs, x: (None, (None,) * len(projs)))
    monkeypatch.setattr(fp8_unsloth, "_fast_lora", lambda: fake)
    return fake


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_patched_fused_layers_compute_what_peft_computes_with_fp8_bases(fake_unsloth):
    from jobs.training.fp8.matmul import rel_error

    model, attn, mlp = _block()
    x = torch.randn(2, 24, 64)

    def step():
        xi = x.clone().requires_grad_(True)
        q, k, v = attn.apply_qkv(attn, xi)
        out = attn.apply_o(attn, q) + mlp(xi) + torch.cat([k, v], -1)
        model.zero_grad()
        (out * torch.linspace(-1, 1, 64)).sum().backward()
        return out.detach(), xi.grad, _grads(model)

    ref = step()  # nothing converted: the functions as shipped (here PEFT's modules)
    units = find_units(model)
    assert sorted((u.kind, u.route) for u in units) == [("mlp", "fused"), ("o", "fused"), ("qkv", "fused")]
    conv = Conversion(keep_originals=True).run(units)
    assert conv.converted == 7 and attn._ns_fp8_qkv is not None and mlp._ns_fp8_mlp is not None
    calls = dict(STATS.fp8_calls)
    got = step()
    assert {k: STATS.fp8_calls.get(k, 0) - calls.get(k, 0) for k in ("qkv", "o", "mlp")} == {"qkv": 1, "o": 1, "mlp": 1}
    assert 0.005 < rel_error(got[0], ref[0]) < 0.06 and rel_error(got[1], ref[1]) < 0.06
    for name, g in ref[2].items():
        assert rel_error(got[2][name], g) < 0.06, name
    assert conv.revert() == 7 and _fp8_bases(model) == 0
    again = step()
    assert torch.equal(again[0], ref[0])  # reverted: exactly the bf16 path again


def test_a_converted_layer_that_is_not_plain_lora_runs_its_projections_as_modules_and_is_counted(fake_unsloth):
    model, attn, _mlp = _block()
    Conversion().run(find_units(model))
    fake_unsloth._lora_dropout_and_bias = lambda projs, x: ((0.1,) * len(projs), (None,) * len(projs))
    before = STATS.native_calls.get("qkv: LoRA dropout", 0)
    x = torch.randn(1, 4, 64)
    q, _, _ = attn.apply_qkv(attn, x)  # not Unsloth's function: it would read the FP8 base as a dense weight
    assert STATS.native_calls["qkv: LoRA dropout"] == before + 1 and torch.equal(q, attn.q_proj(x))
    with fp8_unsloth.capturing():  # the capture pass calls the projections as modules
        seen = []
        hook = attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
        attn.apply_qkv(attn, torch.randn(1, 4, 64))
        hook.remove()
    assert seen == [(1, 4, 64)]


def test_the_base_scored_with_the_adapter_off_runs_on_the_fp8_bases_not_unsloths_function(fake_unsloth):
    model, attn, mlp = _block()
    Conversion().run(find_units(model))
    fake_unsloth._active_lora_adapter = lambda p: None if p.disable_adapters else "default"
    fake_unsloth._lora_dropout_and_bias = lambda projs, x: (None if any(p.disable_adapters for p in projs)
                                                            else (None, (None,) * len(projs)))
    x = torch.randn(1, 6, 64)
    with_lora = attn.apply_qkv(attn, x)[0], attn.apply_o(attn, x), mlp(x)
    with model.disable_adapter():  # how the night scores the base (jobs/night/measure.py)
        q, _, _ = attn.apply_qkv(attn, x)
        o, m = attn.apply_o(attn, x), mlp(x)
        assert torch.equal(q, attn.q_proj.base_layer(x)) and torch.equal(o, attn.o_proj.base_layer(x))
        gate, up = mlp.gate_proj.base_layer(x), mlp.up_proj.base_layer(x)
        assert torch.allclose(m, mlp.down_proj.base_layer(torch.nn.functional.silu(gate) * up))
    back = attn.apply_qkv(attn, x)[0], attn.apply_o(attn, x), mlp(x)
    assert all(torch.allclose(a, b) for a, b in zip(back, with_lora, strict=True))  # the adapter on again
    assert not torch.allclose(back[0], q)


def test_a_layer_whose_fp8_function_raised_runs_its_projections_as_modules_for_good(fake_unsloth, monkeypatch):
    from jobs.training.fp8 import lora as fp8_lora

    model, attn, _ = _block()
    Conversion().run(find_units(model))
    calls = []

    def broken(*a):
        calls.append(1)
        raise RuntimeError("a kernel refused")

    monkeypatch.setattr(fp8_lora.FP8LoraW, "apply", broken)
    x = torch.randn(1, 4, 64)
    for _ in range(2):
        assert torch.equal(attn.apply_o(attn, x), attn.o_proj(x))
    assert len(calls) == 1 and attn.__dict__["_ns_modules_o"]


def test_a_fused_layer_converts_whole_or_not_at_all_and_every_fallback_is_counted(fake_unsloth):
    model, attn, _ = _block()
    k = attn.k_proj.base_layer
    attn.k_proj.base_layer = torch.nn.Linear(64, 40, bias=False)  # 40: not divisible by 16
    attn.k_proj.base_layer.weight.requires_grad_(False)
    del k
    conv = Conversion().run(find_units(model))
    assert conv.converted == 4  # o, gate, up, down; q and v stay with k
    assert conv.fallbacks == {"shape (40, 64) not divisible by 16": 1, "its fused layer stays bf16": 2}
    assert "_ns_fp8_qkv" not in attn.__dict__ and isinstance(attn.o_proj.base_layer, FP8Base)
    # the same projections behind PEFT's module forwards convert one by one
    model2, attn2, _ = _block()
    del attn2.__dict__["apply_qkv"]
    attn2.k_proj.base_layer = torch.nn.Linear(64, 40, bias=False).requires_grad_(False)
    conv2 = Conversion().run(find_units(model2))
    assert conv2.converted == 6 and conv2.fallbacks == {"shape (40, 64) not divisible by 16": 1}


def test_a_fused_layer_with_lora_dropout_stays_bf16(fake_unsloth):
    model, attn, _ = _block()
    attn.k_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    conv = Conversion().run(find_units(model))
    assert conv.converted == 4 and conv.fallbacks == {"LoRA dropout (the FP8 layers run plain LoRA)": 3}


def test_a_layer_with_too_much_error_stays_bf16(fake_unsloth, monkeypatch):
    import jobs.training.fp8.convert as fc
    from jobs.contract import LayerNumerics

    model, _, _ = _block()

    def check(name, w, fp8, from_nf4):
        return LayerNumerics(name=name, shape=tuple(w.shape), fp8=0.5 if name.endswith("o_proj") else 0.03)

    conv = Conversion(check=check).run(find_units(model))
    assert conv.converted == 6 and conv.fallbacks == {f"FP8 error 0.5 over {fc.MAX_LAYER_ERROR}": 1}
    assert [x.fallback for x in conv.layers if not x.converted] == [f"FP8 error 0.5 over {fc.MAX_LAYER_ERROR}"]


def _night_cfg(night_env, compute: str):
    _inbox, make = night_env
    return make(train={"compute": compute, "batching": "packed", "tokens_per_step": 256})


def test_calibrate_check_passes_on_a_learnable_task_and_refuses_with_the_reason(night_env, tiny_model, monkeypatch):
    import jobs.training.fp8.convert as fc
    import jobs.training.fp8.numerics as nm
    from jobs.training.fp8.enable import Learnable, calibrate_fp8

    ok = CardInfo("NVIDIA H200", (9, 0), True)
    learn = Learnable(steps=5, tokens_per_step=128, lr=1e-2)
    loaded = _load(tiny_model)
    decision, out = calibrate_fp8(loaded, _night_cfg(night_env, "auto"), tiny_model, learnable=learn, card=ok)
    n = out.numerics
    assert decision.compute == "fp8" and decision.refused is None and n.passed
    assert len(n.loss_bf16) == len(n.loss_fp8) == 5 and n.loss_max_rel_diff <= n.loss_tolerance == 0.03
    assert _fp8_bases(loaded.model) == 28

    monkeypatch.setattr(fc, "MAX_LAYER_ERROR", 1e-4)  # a card whose FP8 would be this bad
    monkeypatch.setattr(nm, "MAX_LAYER_ERROR", 1e-4)
    loaded = _load(tiny_model)
    decision, out = calibrate_fp8(loaded, _night_cfg(night_env, "auto"), tiny_model, learnable=learn, card=ok)
    assert decision.compute == "bf16" and decision.error is None
    assert "FP8 numerics check failed" in decision.refused and "over 0.0001" in decision.refused
    assert _fp8_bases(loaded.model) == 0  # everything kept in bf16
    decision, _ = calibrate_fp8(_load(tiny_model), _night_cfg(night_env, "fp8"), tiny_model, learnable=learn,
                                card=ok)
    assert decision.error and decision.error.startswith("refusing FP8: FP8 numerics check failed")
    decision, out = calibrate_fp8(_load(tiny_model), _night_cfg(night_env, "auto"), tiny_model,
                                  card=CardInfo("NVIDIA A100", (8, 0), True))
    assert out is None and "has no FP8 tensor cores" in decision.refused


def test_the_loss_comparison_catches_a_broken_fp8_path():
    from jobs.training.fp8.numerics import compare_losses

    bf16 = [7.6, 7.5, 7.3, 7.1, 6.9, 6.6, 6.3, 6.0, 5.8, 5.5]
    worst, ok, learned, why = compare_losses(bf16, [v * 1.01 for v in bf16])
    assert ok and learned and worst == pytest.approx(0.01)
    worst, ok, _, why = compare_losses(bf16, [7.6] * 10)  # FP8 that does not learn
    assert not ok and "loss differs from bf16 by" in why
    assert compare_losses(bf16, [float("nan")] * 10)[3] == "FP8 loss is not finite"
    assert not compare_losses(bf16, [bf16[0]] + [bf16[i // 2] for i in range(1, 10)])[1]  # FP8 learning at half speed


# The learnable task on the H100 (2026-11-25, random-initialised Llama-3.1-8B, 30 steps of 1,024 tokens):
# FP8's curve follows bf16's from 12.6 down to ~0.1; the last window is 8 % apart as a share of its own loss.
H100_BF16 = [12.64218, 12.12565, 11.5111, 10.7405, 7.598, 7.19269, 8.39078, 5.92086, 4.13464, 3.452, 2.29966,
             1.6545, 1.60806, 0.94264, 1.10019, 0.68324, 0.64309, 0.4764, 0.3783, 0.75528, 0.23146, 0.1041,
             0.24363, 0.18468, 0.21489, 0.13279, 0.14182, 0.11828, 0.07688, 0.12475]
H100_FP8 = [12.60689, 12.17316, 11.64451, 10.80012, 7.93067, 7.25271, 8.41282, 6.12762, 4.24923, 3.5729, 2.50098,
            1.77332, 1.69829, 1.00223, 1.13049, 0.72157, 0.67725, 0.51195, 0.36892, 0.7799, 0.23771, 0.12023,
            0.25312, 0.20498, 0.23513, 0.13113, 0.12026, 0.10167, 0.06925, 0.12391]


def test_a_curve_learned_down_to_noise_is_judged_against_the_starting_loss():
    from jobs.training.fp8.numerics import compare_losses

    worst, ok, learned, why = compare_losses(H100_BF16, H100_FP8)
    assert ok and learned and why is None and worst == pytest.approx(0.0101, abs=5e-4)
    lagging = [H100_BF16[max(0, i - 3)] for i in range(30)]  # the same curve three steps late
    assert not compare_losses(H100_BF16, lagging)[1]


def test_nf4_emulation_gives_nf4s_known_error():
    from jobs.training.fp8.matmul import quant_rows_ref, rel_error
    from jobs.training.fp8.numerics import NF4_CODE, nf4_roundtrip

    w = torch.randn(256, 512) * 0.02
    back = nf4_roundtrip(w)
    # NF4 error median 9.2 % on the H100 and H200 (RESULTS.md: 2026-11-25, 8B FP8 calibrate)
    assert 0.08 < rel_error(back, w) < 0.11
    blocks = back.view(-1, 64)
    codes = (blocks / blocks.abs().amax(1, keepdim=True)).unique().tolist()
    assert all(min(abs(v - c) for c in NF4_CODE) < 1e-5 for v in codes)  # every value on the 16-value code
    q, s = quant_rows_ref(w)
    assert rel_error(q.float() * s, w) < 0.035  # e4m3 per row: ~2.6 %


def test_a_night_on_the_cpu_says_cpu_and_fp8_there_is_a_clear_error(night_env):
    from tests.conftest import copy_samples, run

    inbox, make = night_env
    copy_samples(inbox)
    summary = run(make(plan={"max_samples": 24}))
    assert summary["outcome"] == "succeeded", summary["error"]
    assert summary["step_shape"]["compute"] == "bf16" and "compute: CPU" in summary["step_shape"]["basis"]
    assert "FP8" not in summary["step_shape"]["basis"]
    failed = run(make(train={"compute": "fp8"}), night="2026-11-22")
    assert failed["outcome"] == "failed" and '[train] compute = "fp8": no CUDA device' in failed["error"]


def _fake_unsloth_package(monkeypatch, version="2026.10.9"):
    """Enough of `unsloth` for install(): the version and fast_lora's names."""
    import sys

    def apply_lora_qkv(self, x, inplace=True):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def apply_lora_o(self, x):
        return self.o_proj(x)

    def apply_lora_mlp_swiglu(self, x, inplace=True):
        return type(self).forward(self, x)

    fl = types.ModuleType("unsloth.kernels.fast_lora")
    fl.__dict__.update(apply_lora_qkv=apply_lora_qkv, apply_lora_o=apply_lora_o,
                       apply_lora_mlp_swiglu=apply_lora_mlp_swiglu, _lora_dropout_and_bias=None,
                       _has_multiple_active_adapters=None, _has_active_dora_adapter=None,
                       _has_activation_fake_quantizer=None, _active_lora_adapter=None)
    kernels = types.ModuleType("unsloth.kernels")
    kernels.fast_lora = fl
    pkg = types.ModuleType("unsloth")
    pkg.__version__, pkg.kernels = version, kernels
    for name, mod in (("unsloth", pkg), ("unsloth.kernels", kernels), ("unsloth.kernels.fast_lora", fl)):
        monkeypatch.setitem(sys.modules, name, mod)
    return fl


def test_install_replaces_unsloths_fused_functions_per_instance_or_reports_why_not(monkeypatch):
    fl = _fake_unsloth_package(monkeypatch)
    model, attn, mlp = _block()
    attn.apply_qkv, attn.apply_o = fl.apply_lora_qkv, fl.apply_lora_o  # as Unsloth's patch_peft_model binds
    mlp.forward = types.MethodType(fl.apply_lora_mlp_swiglu, mlp)
    assert [u.route for u in find_units(model)] == ["blocked"] * 3  # not ours yet: nothing may convert
    rep = fp8_unsloth.install(model)
    assert (rep.status, rep.qkv, rep.o, rep.mlp) == ("patched", 1, 1, 1)
    assert attn.apply_qkv is fp8_unsloth.fp8_apply_qkv and attn._ns_orig_apply_qkv is fl.apply_lora_qkv
    assert mlp.forward.__func__ is fp8_unsloth.fp8_apply_mlp and mlp._ns_orig_mlp.__func__ is fl.apply_lora_mlp_swiglu
    assert [u.route for u in find_units(model)] == ["fused"] * 3

    model2, _, _ = _block()
    _fake_unsloth_package(monkeypatch, version="2027.1.1")
    rep = fp8_unsloth.install(model2)
    assert rep.status == "unavailable" and "written against Unsloth 2026.10.9, found 2027.1.1" in rep.detail


def test_the_capture_forward_runs_eagerly_even_through_compiled_blocks(tiny_model):
    """On the H200 the capture forward through Unsloth's compiled blocks, hooked, recompiled for 241 s."""
    import torch

    from jobs.training.fp8.numerics import Capture

    loaded = _load(tiny_model)
    compiles = []

    def counting(gm, _inputs):
        compiles.append(gm)
        return gm.forward

    layer = loaded.model.base_model.model.model.layers[0]
    layer.forward = torch.compile(layer.forward, backend=counting)
    cap = Capture(loaded.model, rows=8).run(loaded.model, list(range(5, 37)), "cpu")
    assert compiles == [] and cap.x  # nothing compiled, every projection's input kept
    torch._dynamo.reset()


def _qv_block(dropout: float = 0.0):
    """A decoder layer as Unsloth runs it with an adapter on q and v only (the Exxact study's): its attention
    forward reads `apply_qkv` (none bound: Unsloth fused nothing), its MLP is transformers' SwiGLU forward."""
    from peft import LoraConfig, get_peft_model

    def qkv(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    class Attn(_Projections):
        def _fast_forward(self, x):
            q, k, v = getattr(self, "apply_qkv", qkv)(self, x)
            return self.o_proj(q) + torch.cat([k, v], -1)

        @functools.wraps(_fast_forward)  # Unsloth's class forward is a wrapper of its fast forward
        def forward(self, *args):
            return Attn._fast_forward(self, *args)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = Attn(), _SwiGLU()

        def forward(self, x):
            return self.self_attn(x) + self.mlp(x)

    torch.manual_seed(0)
    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                               target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
        elif not p.requires_grad:
            p.data.normal_(0, 0.05)
    return model, model.base_model.model.self_attn, model.base_model.model.mlp


def test_an_adapter_on_q_and_v_only_runs_its_layers_fused_on_fp8(monkeypatch):
    """Unsloth fuses a layer only where LoRA wraps all of q, k, v (all of gate, up, down): under the Exxact
    study's adapter it fused nothing, and each FP8 projection quantised the same input again, with an add per
    extra input gradient and autograd's SwiGLU. install() now binds our Functions there too: one quantisation and
    one input-gradient GEMM per group, k's and the MLP's bases without LoRA."""
    from jobs.training.fp8.matmul import rel_error

    _fake_unsloth_package(monkeypatch)
    model, attn, mlp = _qv_block()
    x = torch.randn(2, 24, 64)

    def step():
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        model.zero_grad()
        (out * torch.linspace(-1, 1, 64)).sum().backward()
        return out.detach(), xi.grad, _grads(model)

    ref = step()
    rep = fp8_unsloth.install(model)
    assert (rep.status, rep.qkv, rep.o, rep.mlp) == ("patched", 1, 0, 1)
    assert torch.equal(step()[0], ref[0])  # bound but nothing converted: the modules, as before
    monkeypatch.setattr(fp8_unsloth, "_fast_lora", lambda: types.SimpleNamespace(
        _has_multiple_active_adapters=lambda p: False, _has_active_dora_adapter=lambda p: False,
        _has_activation_fake_quantizer=lambda p: False, _active_lora_adapter=lambda p: "default",
        _lora_dropout_and_bias=lambda projs, x: (None, (None,) * len(projs))))
    units = find_units(model)
    assert sorted((u.kind, u.route) for u in units) == [("frozen", "modules"), ("mlp", "fused"), ("qkv", "fused")]
    conv = Conversion(keep_originals=True).run(units)
    assert conv.converted == 7 and not conv.fallbacks
    assert attn._ns_fp8_qkv is not None and isinstance(attn.k_proj, FP8Base) and isinstance(mlp.up_proj, FP8Base)
    calls = dict(STATS.fp8_calls)
    got = step()
    assert {k: STATS.fp8_calls.get(k, 0) - calls.get(k, 0) for k in ("qkv", "mlp", "linear")} == \
        {"qkv": 1, "mlp": 1, "linear": 1}  # o alone, as its own FP8Linear
    assert 0.005 < rel_error(got[0], ref[0]) < 0.06 and rel_error(got[1], ref[1]) < 0.06
    assert sorted(ref[2]) == sorted(got[2]) and len(ref[2]) == 4  # q's and v's A and B
    for name, g in ref[2].items():
        assert rel_error(got[2][name], g) < 0.06, name
    assert conv.revert() == 7 and _fp8_bases(model) == 0 and torch.equal(step()[0], ref[0])


def test_an_unfused_layer_whose_lora_is_not_plain_keeps_its_projections_one_by_one(monkeypatch):
    _fake_unsloth_package(monkeypatch)
    model, attn, mlp = _qv_block(dropout=0.1)
    rep = fp8_unsloth.install(model)
    assert (rep.qkv, rep.mlp) == (0, 1)  # q and v carry dropout: PEFT's forward runs them
    units = find_units(model)
    assert sorted((u.kind, u.route) for u in units) == [("frozen", "modules"), ("frozen", "modules"),
                                                        ("linear", "modules"), ("linear", "modules"),
                                                        ("mlp", "fused")]
    conv = Conversion().run(units)
    assert conv.converted == 7 and "_ns_fp8_qkv" not in attn.__dict__ and mlp._ns_fp8_mlp is not None
    model2, attn2, _ = _qv_block()
    attn2.k_proj = torch.nn.Linear(64, 32, bias=True).requires_grad_(False)  # Qwen2's q, k, v carry a bias
    assert (fp8_unsloth.install(model2).qkv, Conversion().run(find_units(model2)).converted) == (0, 7)
