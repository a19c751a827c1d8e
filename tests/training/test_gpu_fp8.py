"""GPU checks of the FP8 frozen base (issue 16): skipped without CUDA, unsloth or FP8 tensor cores.

python -m pytest tests/training/test_gpu_fp8.py -q -m gpu
"""

from __future__ import annotations

import pytest

from tests.training.conftest import fp8_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = fp8_gpu_marks("unsloth")


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(4096, 4096), (1024, 4096), (1024, 4096)]),
    ("o", [(4096, 4096)]),
    ("mlp", [(14336, 4096), (14336, 4096), (4096, 14336)]),
    ("linear", [(1024, 4096)]),
])
def test_functions_on_the_card_match_fp32_and_the_emulation(kind, shapes):
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    from jobs.training.fp8.matmul import emulated
    from jobs.training.fp8.selftest import check_kind, verdict

    sw = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel) if kind == "mlp" else None
    err = check_kind(kind, shapes, tokens=1000, swiglu=sw)
    assert verdict(kind, err) is None, err
    assert 0.005 < err["out0"] < 0.06 and 0.005 < err["dx"] < 0.06
    with emulated():
        emu = check_kind(kind, shapes, tokens=1000, swiglu=sw)
    assert abs(emu["dx"] - err["dx"]) < 0.01 and abs(emu["out0"] - err["out0"]) < 0.01



@pytest.mark.parametrize(("kind", "shapes", "with_lora"), [
    ("qkv", [(4096, 4096), (1024, 4096), (1024, 4096)], (True, False, True)),
    ("mlp", [(14336, 4096), (14336, 4096), (4096, 14336)], (False, False, False)),
])
def test_layers_with_lora_on_some_projections_run_fused_on_the_card(kind, shapes, with_lora):
    """The Exxact study's adapter (q and v): k and the MLP have no LoRA, the Functions run them all the same."""
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    from jobs.training.fp8.selftest import check_kind, verdict

    sw = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel) if kind == "mlp" else None
    err = check_kind(kind, shapes, tokens=1000, swiglu=sw, with_lora=with_lora, lora_dtype=torch.float32)
    assert verdict(kind, err) is None, err
    assert err["dx"] > 0.005 and {k for k in err if k[:2] == "dA"} == {  # verdict: within FP8's limit
        f"dA{i}" for i, on in enumerate(with_lora) if on}


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(4096, 4096), (1024, 4096), (1024, 4096)]),
    ("mlp", [(14336, 4096), (14336, 4096), (4096, 14336)]),
])
def test_fp32_lora_weights_train_through_the_card_without_a_cast_in_the_backward(kind, shapes):
    """PEFT's fp32 LoRA weights under bf16 activations: within FP8's error of fp32, and the backward converts no
    dtype (the forward's bf16 copies are reused, cuBLAS writes the fp32 gradients)."""
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    from jobs.training.fp8.lora import FP8LoraMLP, FP8LoraQKV
    from jobs.training.fp8.matmul import FP8Base, FP8Group
    from jobs.training.fp8.selftest import check_kind, verdict

    sw = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel) if kind == "mlp" else None
    err = check_kind(kind, shapes, tokens=1000, swiglu=sw, lora_dtype=torch.float32)
    assert verdict(kind, err) is None, err

    torch.manual_seed(0)
    bases = [FP8Base.from_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for n, k in shapes]
    params = [t for n, k in shapes for t in (torch.randn(16, k, device="cuda", requires_grad=True),
                                             torch.randn(n, 16, device="cuda", requires_grad=True), 1.0)]
    x = torch.randn(1, 1000, shapes[0][1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if kind == "qkv":
        outs = FP8LoraQKV.apply(x, FP8Group(bases, keep_transposed=False), *params)
    else:
        outs = (FP8LoraMLP.apply(x, FP8Group([bases[1], bases[0]], keep_transposed=False),
                                 FP8Group([bases[2]], keep_transposed=False), *params, *sw),)
    dys = [torch.randn_like(o) for o in outs]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.backward(outs, dys)
        torch.cuda.synchronize()
    ops = [e.name for e in prof.events()]
    assert "aten::_to_copy" not in ops, sorted(set(ops))
    assert all(p.grad.dtype == torch.float32 for p in params if isinstance(p, torch.Tensor))


def test_an_unsloth_model_runs_fp8_patched_checked_and_trains(small_model, tmp_path):
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.fp8.enable import CAPTURE_TOKENS, Learnable, enable_fp8
    from jobs.training.fp8.matmul import STATS, FP8Base
    from jobs.training.fp8.numerics import bigram_samples
    from jobs.training.fp8.sample_data import data_files, sample_tokens
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, tok, _info = load_unsloth(small_model, lora=LoraSpec(r=16, alpha=16), max_seq_length=4096,
                                     gradient_checkpointing=False, cache_dir=tmp_path)
    ids, source = sample_tokens(tok, data_files(None, []), n=CAPTURE_TOKENS)
    out = enable_fp8(model, device="cuda", tokens=ids, activations=source, unsloth=True, source_dir=small_model,
                     learnable=Learnable(steps=10, tokens_per_step=1024), vocab=len(tok))
    assert out.error is None, out.error
    assert out.patch["status"] == "patched" and (out.patch["qkv"], out.patch["o"], out.patch["mlp"]) == (2, 2, 2)
    n = out.numerics
    assert n.passed, n.reasons
    assert n.converted == 14 and sum(isinstance(m, FP8Base) for m in model.modules()) == 14
    assert n.nf4_error["median"] > n.fp8_error["median"]  # real bitsandbytes NF4 against the bf16 source
    calls, native = dict(STATS.fp8_calls), dict(STATS.native_calls)  # process-wide: earlier tests count too
    opt = make_optimizer(model)
    for b in list(packed_batches(bigram_samples(len(tok), 5000), tokens_per_step=2048))[:2]:
        st = train_step(model, b, opt)
        assert st.loss == st.loss
    assert STATS.fp8_calls["mlp"] >= calls.get("mlp", 0) + 4 and STATS.native_calls == native


def test_a_q_v_adapter_on_unsloth_runs_every_frozen_projection_on_fp8(small_model, tmp_path):
    """The Exxact recipe's adapter: Unsloth fuses nothing; q, k, v and the MLP run the fused FP8 Functions all the
    same (k and the MLP without LoRA), o alone as its own FP8 module."""
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.fp8.enable import CAPTURE_TOKENS, enable_fp8
    from jobs.training.fp8.matmul import STATS, FP8Base
    from jobs.training.fp8.numerics import bigram_samples
    from jobs.training.fp8.sample_data import data_files, sample_tokens
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, tok, _info = load_unsloth(small_model, lora=LoraSpec(r=16, alpha=32, target_modules=["q_proj", "v_proj"]),
                                     max_seq_length=4096, gradient_checkpointing=False, cache_dir=tmp_path)
    ids, source = sample_tokens(tok, data_files(None, []), n=CAPTURE_TOKENS)
    out = enable_fp8(model, device="cuda", tokens=ids, activations=source, unsloth=True, source_dir=small_model)
    assert out.error is None, out.error
    n = out.numerics
    assert n.passed, n.reasons
    assert n.converted == 14 and sum(isinstance(m, FP8Base) for m in model.modules()) == 14, out.conversion
    assert (out.patch["status"], out.patch["qkv"], out.patch["o"], out.patch["mlp"]) == ("patched", 2, 0, 2)
    calls, native = dict(STATS.fp8_calls), dict(STATS.native_calls)  # process-wide: earlier tests count too
    opt = make_optimizer(model)
    for b in list(packed_batches(bigram_samples(len(tok), 5000), tokens_per_step=2048))[:2]:
        st = train_step(model, b, opt)
        assert st.loss == st.loss
    # 2 layers x 2 steps: each layer's q, k, v once, its MLP once, o alone
    assert {k: STATS.fp8_calls.get(k, 0) - calls.get(k, 0) for k in ("qkv", "mlp", "linear")} == \
        {"qkv": 4, "mlp": 4, "linear": 4} and STATS.native_calls == native
