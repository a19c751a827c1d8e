# ruff: noqa  (a kernel version measured on the device, kept as it ran; not part of the package)
"""NF4 -> e4m3 in one pass, into [N, K] or its transpose (jobs/training/fp8_nf4.py says why and what it computes).

One program takes a BLOCK_N x BLOCK_K tile of the [N, K] weight: it reads the tile's packed bytes (each once per
value: the pair of a byte sits in one tile, the second load hits the cache), its absmax (one per `blocksize` values;
nested: the byte's code2 value times absmax2 plus the offset), rounds code[nibble] * absmax to bf16 as bitsandbytes
does, and casts it over the row's scale to e4m3 with the quantisation kernel's exact rounding (`_to_e4m3`). The
output is addressed by strides, so the same kernel writes the forward's row-major [N, K] and the input gradient's
[K, sum N] column slice. Compiled without floating-point contraction: a fused multiply-add would round
code2 * absmax2 + offset differently from bitsandbytes' two operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobs.training.fp8_format import FMAX
from jobs.training.fp8_nf4 import NF4Source
from jobs.training.fp8_quant_kernel import _to_e4m3

BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def nf4_to_e4m3(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, scale_ptr, out_ptr, n_rows, n_cols,
                out_stride_n, out_stride_k, fmax, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                NESTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < n_rows) & (rk[None, :] < n_cols)
    idx = rn[:, None] * n_cols + rk[None, :]
    byte = tl.load(packed_ptr + idx // 2, mask=mask, other=0).to(tl.int32)
    nib = tl.where(idx % 2 == 0, byte >> 4, byte & 15)
    value = tl.load(code_ptr + nib, mask=mask, other=0.0)
    block = idx // BLOCKSIZE
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        amax = tl.load(code2_ptr + q, mask=mask, other=0.0) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask,
                                                                       other=0.0) + offset
    else:
        amax = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    w = (value * amax).to(tl.bfloat16).to(tl.float32)
    s = tl.load(scale_ptr + rn, mask=rn < n_rows, other=1.0)
    q8 = _to_e4m3(w, s[:, None], fmax)
    tl.store(out_ptr + rn[:, None] * out_stride_n + rk[None, :] * out_stride_k, q8, mask=mask)


def nf4_to_fp8(src: NF4Source, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`nf4_to_fp8_ref` on CUDA: `out` any [N, K] view of e4m3 (the weight, or `t.t()` of a transposed slice)."""
    n, k = src.shape
    if tuple(out.shape) != (n, k):
        raise ValueError(f"out is {tuple(out.shape)}, the weight {n}x{k}")
    if n == 0 or k == 0:
        return out
    nested = (src.absmax2, src.code2, src.offset) if src.nested else (src.code, src.code, 0.0)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
    nf4_to_e4m3[grid](src.packed, src.absmax, src.code, nested[0], nested[1], nested[2], scale, out, n, k,
                      out.stride(0), out.stride(1), FMAX, BLOCKSIZE=src.blocksize,
                      BLOCKSIZE2=src.blocksize2 if src.nested else 1, NESTED=src.nested, BLOCK_N=BLOCK_N,
                      BLOCK_K=BLOCK_K, num_warps=8, enable_fp_fusion=False)
    return out
