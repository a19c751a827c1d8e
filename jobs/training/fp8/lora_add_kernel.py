"""A LoRA product added into a base output as one Triton kernel (issue 16): out += alpha * xa @ b^T.

Why: in the FP8 Functions (jobs/training/fp8/lora.py) every projection's output, and every input
gradient, gets its LoRA share added by `addmm_` — a GEMM of inner size r (16) over an [M, N] output it
reads and writes, memory-bound. cuBLAS ran it at ~1.9 TB/s on one H100 (216 us for the 8B's gate output,
7,168 x 14,336); this kernel, one [64, 128] tile of out a program with the rank-r product from one
`tl.dot`, at ~2.7 TB/s (150 us). Below 2^24 elements cuBLAS was faster (12 against 20 us at 7,168 x 1,024),
so smaller outputs keep `addmm_` (RESULTS.md: 2026-11-26, quant and LoRA-add kernels).

The arithmetic is addmm_'s: the rank-r product accumulated in fp32, times alpha, plus out in fp32, rounded
once to out's dtype; b is cast to xa's dtype first (a no-op for the FP8 Functions, which pass the bf16
copies they saved).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from jobs.training.fp8.matmul import lora_add_ref

MIN_ELEMENTS = 1 << 24  # outputs smaller than this keep cuBLAS's addmm_ (measured, above)
MAX_RANK = 128  # wider ranks keep addmm_ (the sweep ran ranks up to 64, the GPU tests up to 48)
BM, BN, WARPS = 64, 128, 8  # within 2 % of the best of 18 tile shapes on every output above 2^24 elements


@functools.cache
def _jit() -> Any:
    """The kernel, defined on first use: Triton is imported here, so that a machine without it imports this module."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["m"])  # m, the step's tokens, varies: one compiled variant, not one per m % 16
    def _lora_add_kernel(out_ptr, out_stride, xa_ptr, xa_stride, b_ptr, b_sn, b_sr, m, n, r, alpha,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        in_m, in_n, in_r = rm < m, rn < n, rr < r
        xa = tl.load(xa_ptr + rm[:, None] * xa_stride + rr[None, :], mask=in_m[:, None] & in_r[None, :], other=0.0)
        bt = tl.load(b_ptr + rn[None, :] * b_sn + rr[:, None] * b_sr, mask=in_r[:, None] & in_n[None, :], other=0.0)
        acc = tl.dot(xa, bt.to(xa.dtype))
        ptrs = out_ptr + rm[:, None] * out_stride + rn[None, :]
        inside = in_m[:, None] & in_n[None, :]
        o = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        tl.store(ptrs, (o + alpha * acc).to(out_ptr.dtype.element_ty), mask=inside)

    return _lora_add_kernel


def takes(out: torch.Tensor, xa: torch.Tensor) -> bool:
    """Whether the kernel runs this product (else `addmm_`): CUDA, rows contiguous, big enough to win."""
    return (out.is_cuda and out.numel() >= MIN_ELEMENTS and xa.shape[1] <= MAX_RANK
            and out.stride(1) == 1 and xa.stride(1) == 1 and xa.dtype == out.dtype)


def lora_add_(out: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, alpha: float, *, b_rows_are_rank: bool = False
              ) -> torch.Tensor:
    """out [M, N] += alpha * xa [M, r] @ B^T, where B is `b` [N, r] (a LoRA B), or with `b_rows_are_rank`
    `b` [r, N] (a LoRA A: out += xa @ b); in place, returned. The kernel where `takes`, else addmm_."""
    if not takes(out, xa):
        return lora_add_ref(out, xa, b, alpha, b_rows_are_rank=b_rows_are_rank)
    m, n = out.shape
    r = xa.shape[1]
    sn, sr = (b.stride(1), b.stride(0)) if b_rows_are_rank else (b.stride(0), b.stride(1))
    _jit()[(-(-m // BM), -(-n // BN))](
        out, out.stride(0), xa, xa.stride(0), b, sn, sr, m, n, r, float(alpha),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_R=max(16, 1 << (r - 1).bit_length()), num_warps=WARPS)
    return out
