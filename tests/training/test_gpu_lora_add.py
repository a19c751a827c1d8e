"""The Triton LoRA add (out += alpha xa B^T) against fp64 and cuBLAS's addmm_ on the card (issue 16):
skipped without CUDA, Triton or FP8 tensor cores (it serves the FP8 Functions).

python -m pytest tests/training/test_gpu_lora_add.py -q -m gpu
"""

from __future__ import annotations

import pytest

from tests.training.conftest import fp8_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = fp8_gpu_marks("triton")


def _bf16_ulp(v):
    a = v.abs().clamp(min=2.0 ** -120)
    return 2.0 ** (torch.floor(torch.log2(a)) - 7)


@pytest.mark.parametrize(("m", "n", "r", "b_rows_are_rank", "b_dtype"), [
    (4096, 4096, 16, False, torch.bfloat16),   # exactly 2^24 elements: the smallest the kernel takes
    (1031, 16411, 12, False, torch.float32),   # ragged tiles, a rank not a power of two, an fp32 B
    (2077, 8200, 48, True, torch.bfloat16),    # an input gradient: xa [M, r] @ A [r, N]
])
def test_the_kernel_rounds_once_like_addmm(m, n, r, b_rows_are_rank, b_dtype):
    from jobs.training.fp8 import lora_add_kernel as k

    g = torch.Generator(device="cuda").manual_seed(m)
    out0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    wide = torch.randn(m, r + 20, device="cuda", dtype=torch.bfloat16, generator=g)
    xa = wide[:, 5:5 + r]  # a view of a group's [M, sum r] product: row stride != r
    shape = (r, n) if b_rows_are_rank else (n, r)
    b = (torch.randn(*shape, device="cuda", generator=g) * 0.1).to(b_dtype)
    assert k.takes(out0, xa)
    got = k.lora_add_(out0.clone(), xa, b, 0.75, b_rows_are_rank=b_rows_are_rank)
    bm = (b if b_rows_are_rank else b.t()).to(torch.bfloat16).double()
    exact = out0.double() + 0.75 * (xa.double() @ bm)
    cublas = out0.clone().addmm_(xa, bm.to(torch.bfloat16), alpha=0.75)
    # one rounding of an fp32 sum: within an ulp of the result, plus fp32's error on the terms where they cancel
    tol = _bf16_ulp(exact) + 2.0 ** -22 * out0.double().abs() + 2.0 ** -18 * 0.75 * (xa.double().abs() @ bm.abs())
    assert ((got.double() - exact).abs() <= tol).all()
    assert ((cublas.double() - exact).abs() <= tol).all()  # the bound is cuBLAS's too
    assert (got != out0).float().mean() > 0.5  # the product was added


def test_small_or_strided_outputs_keep_addmm():
    from jobs.training.fp8 import lora_add_kernel as k

    out = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    xa = torch.randn(512, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 16, device="cuda", dtype=torch.bfloat16)
    assert not k.takes(out, xa)
    assert torch.equal(k.lora_add_(out.clone(), xa, b, 2.0), out.clone().addmm_(xa, b.t(), alpha=2.0))
    big = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16).t()  # column-major: not the kernel's
    assert not k.takes(big, torch.randn(4096, 16, device="cuda", dtype=torch.bfloat16))


def test_the_fp8_functions_take_the_kernel_and_stay_within_fp8_error(monkeypatch):
    """The MLP Function at a size where every LoRA add of the forward and of dh goes through the kernel."""
    from jobs.training.fp8 import lora_add_kernel as k
    from jobs.training.fp8.matmul import STATS
    from jobs.training.fp8.selftest import check_kind, verdict

    taken = []
    real = k.takes
    monkeypatch.setattr(k, "takes", lambda out, xa: taken.append(real(out, xa)) or taken[-1])
    err = check_kind("mlp", [(4096, 1024), (4096, 1024), (1024, 4096)], tokens=4096, device="cuda")
    assert verdict("mlp", err) is None, err
    assert sum(taken) >= 3  # gate and up outputs, dh
    assert "lora_add_" not in STATS.compile_fallbacks

