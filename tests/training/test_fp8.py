"""FP8 frozen base (issue 16), CPU side: the quantisation, the emulated scaled matmul and its operand
rules, the autograd Functions against a dense reference, the config switch and the decisions."""

from __future__ import annotations

import pytest
import torch

from jobs.contract import CalibrationRecord, MemoryModel, StepShape
from jobs.training.config import TrainConfig
from jobs.training.fp8.compute import (
    CardInfo,
    assess_card,
    decide_calibration,
    resolve_compute,
    with_compute,
)
from jobs.training.fp8.matmul import (
    E4M3,
    FP8Base,
    FP8Group,
    fp8_dgrad,
    lora_add_ref,
    quant_rows_ref,
    rel_error,
    scaled_mm,
)
from jobs.training.fp8.selftest import check_kind, verdict

H100 = CardInfo("NVIDIA H100 80GB HBM3", (9, 0), True, None)


def test_rows_quantise_to_e4m3_with_one_dequant_scale_per_row():
    t = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]  # rows six decades apart
    t[3] = 0.0  # a padding row
    q, s = quant_rows_ref(t)
    assert q.dtype == E4M3 and s.shape == (8, 1) and s.dtype == torch.float32
    back = q.float() * s
    assert torch.isfinite(back).all() and back[3].abs().max() == 0
    assert back.abs().amax(1)[[0, 7]].tolist() == pytest.approx(t.abs().amax(1)[[0, 7]].tolist(), rel=1e-6)
    assert rel_error(back, t) < 0.04  # 3 mantissa bits: ~2.6 % per row, whatever its magnitude


def test_emulated_scaled_mm_refuses_what_the_cuda_kernel_refuses():
    a, sa = quant_rows_ref(torch.randn(5, 32))  # M is free (5)
    w, sw = quant_rows_ref(torch.randn(48, 32))
    ok = scaled_mm(a, w.t(), sa, sw.view(1, -1), out_dtype=torch.float32, fast_accum=True)
    assert ok.shape == (5, 48)
    with pytest.raises(ValueError, match="column-major"):
        scaled_mm(a, w.t().contiguous(), sa, sw.view(1, -1), out_dtype=torch.float32, fast_accum=True)
    with pytest.raises(ValueError, match="row-major"):
        scaled_mm(a.t().contiguous().t(), w.t(), sa, sw.view(1, -1), out_dtype=torch.float32, fast_accum=True)
    with pytest.raises(ValueError, match=r"scale_b must be contiguous fp32 \(1, 48\)"):
        scaled_mm(a, w.t(), sa, sw, out_dtype=torch.float32, fast_accum=True)  # (N, 1) instead of (1, N)
    b, sb = quant_rows_ref(torch.randn(40, 24))
    c, sc = quant_rows_ref(torch.randn(5, 24))
    with pytest.raises(ValueError, match="divisible by 16"):
        scaled_mm(c, b.t(), sc, sb.view(1, -1), out_dtype=torch.float32, fast_accum=True)


def test_dgrad_folds_the_weight_scales_into_dy_and_sums_a_group_in_one_gemm():
    torch.manual_seed(0)
    b1, b2 = FP8Base.from_weight(torch.randn(32, 64) * 0.02), FP8Base.from_weight(torch.randn(48, 64) * 0.5)
    d1, d2 = torch.randn(10, 32), torch.randn(10, 48)
    dx = fp8_dgrad((d1, d2), FP8Group([b1, b2], keep_transposed=False), torch.float32)
    # exactly the quantised computation: cat(dy_i * s_i) quantised per row, times the stored e4m3 weights
    q, s = quant_rows_ref(torch.cat([d1 * b1.scale_row(), d2 * b2.scale_row()], 1))
    assert torch.allclose(dx, (q.float() * s) @ torch.cat([b1.weight.float(), b2.weight.float()]), rtol=1e-5,
                          atol=1e-6)
    # and the input gradient of y = x W^T within FP8's error, whatever the scales of the two weights
    exact = d1 @ b1.dequantized() + d2 @ b2.dequantized()
    assert 0.005 < rel_error(dx, exact) < 0.05
    kept = fp8_dgrad((d1, d2), FP8Group([b1, b2], keep_transposed=True), torch.float32)
    assert torch.equal(kept, dx)  # the kept transposed copy and the per-backward transpose agree


def test_tiny_gradients_are_not_flushed_to_zero():
    """dy times the weight scales (~1e-4) is quantised per row: a row's scale follows it down (only an
    all-zero row gets the floor), so even 1e-16 gradients keep FP8's relative precision."""
    base = FP8Base.from_weight(torch.randn(64, 32) * 0.02)
    dy = torch.randn(8, 64) * 1e-16
    dx = fp8_dgrad((dy,), base.own_group(), torch.float32)
    assert rel_error(dx, dy @ base.dequantized()) < 0.05


def test_lora_add_adds_the_scaled_product_of_either_layout():
    out, xa = torch.randn(5, 7), torch.randn(5, 3)
    b = torch.randn(7, 3)  # a LoRA B [N, r]
    assert torch.allclose(lora_add_ref(out.clone(), xa, b, 0.5), out + 0.5 * xa @ b.t())
    a = torch.randn(3, 7)  # a LoRA A [r, K]: an input gradient's share
    assert torch.allclose(lora_add_ref(out.clone(), xa, a, 2.0, b_rows_are_rank=True), out + 2.0 * xa @ a)


def test_a_kernel_that_cannot_load_falls_back_to_eager_once_and_is_counted(monkeypatch):
    """Where a Triton kernel would run (CUDA, not emulated) but cannot be imported or compiled, the eager
    function computes the result, the failure is counted once, and later calls go straight to eager."""
    import jobs.training.fp8.matmul as f

    monkeypatch.setattr(f, "_emulating", lambda t: False)
    monkeypatch.setattr(f.STATS, "compile_fallbacks", {})
    calls = []
    k = f._FastPath("missing", lambda *a, **kw: calls.append((a, kw)) or "eager",
                    f._triton("jobs.training.no_such_kernel", "missing"))
    x = torch.zeros(2)
    assert k(x, alpha=1.0) == "eager" and k([x]) == "eager"
    assert len(calls) == 2 and calls[0][1] == {"alpha": 1.0}
    assert list(f.STATS.compile_fallbacks) == ["missing"] and "No module named" in f.STATS.compile_fallbacks["missing"]
    assert k.failed is not None


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)]),
    ("o", [(64, 128)]),
    ("mlp", [(128, 64), (128, 64), (64, 128)]),
    ("linear", [(48, 64)]),
])
def test_functions_match_the_dense_reference_within_fp8_error(kind, shapes):
    err = check_kind(kind, shapes, device="cpu", dtype=torch.bfloat16, tokens=48)
    assert verdict(kind, err) is None, err
    assert err["out0"] > 0.005 and err["dx"] > 0.005  # FP8 really ran (bf16 alone is ~0.3 %)
    assert max(err.values()) < 0.06


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)]),
    ("mlp", [(128, 64), (128, 64), (64, 128)]),
])
def test_a_groups_lora_products_in_one_gemm_keep_each_projections_own_rank(kind, shapes):
    """q/k/v and gate/up share one GEMM for x A^T, dA and dx's LoRA share: with a rank per projection
    (PEFT's rank_pattern) each gradient must still be its own; in fp32 q/k/v's are exact (no FP8 on them)."""
    err = check_kind(kind, shapes, device="cpu", dtype=torch.float32, tokens=48, rank=(4, 8, 2))
    assert verdict(kind, err) is None, err
    if kind == "qkv":
        assert max(v for k, v in err.items() if k[:2] in ("dA", "dB")) < 1e-5


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)]),
    ("o", [(64, 128)]),
    ("mlp", [(128, 64), (128, 64), (64, 128)]),
])
def test_fp32_lora_weights_under_bf16_activations_match_the_reference(kind, shapes):
    """PEFT keeps LoRA weights in fp32 while the activations are bf16: the Functions cast
    them once in the forward and give fp32 gradients."""
    err = check_kind(kind, shapes, device="cpu", dtype=torch.bfloat16, lora_dtype=torch.float32, tokens=48)
    assert verdict(kind, err) is None, err


@pytest.mark.parametrize(("kind", "shapes", "with_lora"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)], (True, False, True)),  # the Exxact study's adapter: q and v
    ("qkv", [(64, 64), (32, 64), (32, 64)], (False, False, False)),
    ("mlp", [(128, 64), (128, 64), (64, 128)], (False, False, False)),
    ("mlp", [(128, 64), (128, 64), (64, 128)], (False, True, False)),
    ("mlp", [(128, 64), (128, 64), (64, 128)], (True, True, False)),
    ("mlp", [(128, 64), (128, 64), (64, 128)], (False, False, True)),
])
def test_projections_without_lora_run_in_the_same_fused_function(kind, shapes, with_lora):
    """An adapter that wraps some of a layer's projections (Unsloth then fuses nothing): the Function takes None
    for the others' A and B, and every output, dx and each present LoRA gradient still match the reference."""
    err = check_kind(kind, shapes, device="cpu", dtype=torch.float32, tokens=48, with_lora=with_lora,
                     lora_dtype=torch.float32)
    assert verdict(kind, err) is None, err
    assert {k for k in err if k[:2] == "dA"} == {f"dA{i}" for i, on in enumerate(with_lora) if on}
    assert err["dx"] > 0.005  # FP8 really ran


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the input shape of every dtype conversion of an fp32 tensor with a rank-sized side (<= 24: a LoRA
    weight, or a group's A's; the emulated FP8 path's own fp32 casts are [tokens, features], both > 24, or 3-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32_casts: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and args[0].dim() == 2 \
                and min(args[0].shape) <= 24:
            self.fp32_casts.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("kind", "n_proj"), [("qkv", 3), ("mlp", 3)])
def test_lora_weights_are_cast_once_in_the_forward_and_never_in_the_backward(kind, n_proj):
    """Casting fp32 LoRA weights at each use was ~25 launches a layer: a group's A's are concatenated then cast
    once, each B cast once, and the backward reuses them."""
    import jobs.training.fp8.lora as fl
    from jobs.training.fp8.selftest import swiglu_backward_ref, swiglu_forward_ref

    torch.manual_seed(0)
    k, n = 64, 32
    shapes = [(n, k)] * 3 if kind == "qkv" else [(128, k), (128, k), (k, 128)]
    bases = [FP8Base.from_weight(torch.randn(o, i) * 0.02) for o, i in shapes]
    params = [t for o, i in shapes for t in (torch.randn(8, i, requires_grad=True),
                                             torch.randn(o, 8, requires_grad=True), 1.0)]
    x = torch.randn(1, 40, k, dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = _Casts(), _Casts()
    with fwd:
        if kind == "qkv":
            outs = fl.FP8LoraQKV.apply(x, FP8Group(bases, keep_transposed=False), *params)
        else:
            outs = (fl.FP8LoraMLP.apply(x, FP8Group([bases[1], bases[0]], keep_transposed=False),
                                        FP8Group([bases[2]], keep_transposed=False), *params,
                                        swiglu_forward_ref, swiglu_backward_ref),)
    with bwd:
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    groups = 1 if kind == "qkv" else 2  # q, k, v share one A cast; gate and up one, down its own
    assert len(fwd.fp32_casts) == groups + n_proj, fwd.fp32_casts
    assert bwd.fp32_casts == []
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params if isinstance(p, torch.Tensor))


def test_a_lora_gradient_is_the_scaled_product_in_its_weights_dtype():
    from jobs.training.fp8.lora import grad_mm

    a, b = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    g = grad_mm(a, b, 2.0, torch.float32)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, (a @ b).float() * 2.0)
    assert grad_mm(a, b, 1.0, torch.bfloat16).dtype == torch.bfloat16


def test_a_wrong_group_order_is_caught_by_the_reference_check(monkeypatch):
    import jobs.training.fp8.lora as fl

    real = fl.fp8_dgrad
    monkeypatch.setattr(fl, "fp8_dgrad", lambda dys, group, dt: real(list(dys)[::-1], group, dt)
                        if len(dys) == 2 else real(dys, group, dt))
    err = check_kind("mlp", [(128, 64), (128, 64), (64, 128)], device="cpu", tokens=16)
    assert verdict("mlp", err) is not None and err["dx"] > 0.3  # [df | de] against [Wgate; Wup]: caught


def test_compute_is_a_config_key_checked_by_name():
    assert TrainConfig().compute == "auto" and not TrainConfig().fp8_keep_transposed
    assert TrainConfig(compute="fp8", fp8_keep_transposed=True).compute == "fp8"
    with pytest.raises(Exception, match="compute"):
        TrainConfig.model_validate({"compute": "fp16"})


def test_auto_on_this_cpu_says_cpu_and_nothing_of_fp8():
    """A CPU night's summary has nothing to say about FP8 (issue 42: the demo's summary ended with it); only
    an operator who asks for fp8 there hears why not."""
    shape = StepShape(tokens_per_step=512, gradient_checkpointing=False, basis="config")
    out = with_compute(shape, TrainConfig(compute="auto"), None, card=CardInfo("cpu", None))
    assert out.compute == "bf16" and out.basis == "config; compute: CPU" and "FP8" not in out.basis
    if not torch.cuda.is_available():
        assert with_compute(shape, TrainConfig(), None).basis == "config; compute: CPU"  # the real card query
    with pytest.raises(ValueError, match=r'\[train\] compute = "fp8": no CUDA device'):
        with_compute(shape, TrainConfig(compute="fp8"), None, card=CardInfo("cpu", None))
    assert with_compute(shape, TrainConfig(compute="bf16"), None).compute == "bf16"


def _record(**kw) -> CalibrationRecord:
    return CalibrationRecord(tokens_per_step=8192, gradient_checkpointing=False, memory=MemoryModel(
        static_gb=7, mb_per_token=3.5), tokens_per_second={"alpaca": 1.0}, max_vram_gb=40, device="H100", **kw)


def test_auto_takes_fp8_only_from_a_calibration_whose_check_passed():
    assert resolve_compute("auto", _record(compute="fp8"), H100).compute == "fp8"
    no = resolve_compute("auto", None, H100)
    assert no.compute == "bf16" and "not calibrated" in no.reason
    refused = resolve_compute("auto", _record(compute="bf16", fp8_refused="FP8 numerics check failed: x"), H100)
    assert refused.compute == "bf16" and "numerics check failed: x" in refused.reason
    assert resolve_compute("fp8", None, H100).compute == "fp8"  # asked for: the per-layer check runs at load
    assert _record(compute="fp8").shape().compute == "fp8"


@pytest.mark.parametrize(("card", "words"), [
    (CardInfo("cpu", None), "no CUDA device"),
    (CardInfo("NVIDIA A100-SXM4-80GB", (8, 0), True), "compute capability 8.0) has no FP8 tensor cores"),
    (CardInfo("NVIDIA GeForce RTX 3090", (8, 6), True), "8.6"),
    (CardInfo("NVIDIA H200", (9, 0), False), "no torch._scaled_mm"),
    (CardInfo("NVIDIA L40S", (8, 9), True, "RuntimeError: not supported"), "row-wise FP8 matmul failed"),
])
def test_cards_without_fp8_are_refused_with_the_reason(card, words):
    ok, why = assess_card(card)
    assert not ok and words in why
    assert assess_card(H100)[0] and assess_card(CardInfo("NVIDIA RTX PRO 6000", (12, 0), True))[0]


def test_calibrate_refuses_fp8_and_says_why():
    d = decide_calibration("auto", True, "", False, "loss differs from bf16 by 7.0 % (> 3 %)")
    assert (d.compute, d.error) == ("bf16", None) and "loss differs from bf16 by 7.0 %" in d.refused
    d = decide_calibration("fp8", True, "", False, "2 projection(s) over 0.08")
    assert d.compute == "bf16" and d.error and "refusing FP8" in d.error and "over 0.08" in d.error
    d = decide_calibration("auto", False, "NVIDIA A100 (compute capability 8.0) has no FP8 tensor cores", None, None)
    assert d.compute == "bf16" and "A100" in d.refused
    assert decide_calibration("auto", True, "", True, None).compute == "fp8"
    assert decide_calibration("bf16", True, "", None, None) == decide_calibration("bf16", False, "", None, None)


def test_the_default_config_keeps_the_throughput_keys_measured_before_fp8(tmp_path):
    from jobs.learning.plan import throughput_key as raw_key
    from jobs.night.config import NightConfig
    from jobs.night.model import throughput_key

    cfg = NightConfig.model_validate({"state_dir": tmp_path, "model": {"path": tmp_path}})
    t = cfg.train
    before = raw_key({
        "model": "f", "backend": "unsloth", "device": "H200", "rank": t.lora_rank,
        "targets": t.target_modules, "batch_size": t.batch_size, "max_tokens": t.max_tokens_per_batch,
        "max_seq": t.max_seq_length, "grad_ckpt": t.gradient_checkpointing, "4bit": True,  # before methods
        "batching": t.batching, "tokens_per_step": t.tokens_per_step, "max_vram_gb": cfg.gpu.max_vram_gb})
    assert throughput_key(cfg, "f", "unsloth", "H200") == before
    fp8 = cfg.model_copy(update={"train": t.model_copy(update={"compute": "fp8"})})
    bf16 = cfg.model_copy(update={"train": t.model_copy(update={"compute": "bf16"})})
    keys = {throughput_key(c, "f", "unsloth", "H200") for c in (cfg, fp8, bf16)}
    assert len(keys) == 3
