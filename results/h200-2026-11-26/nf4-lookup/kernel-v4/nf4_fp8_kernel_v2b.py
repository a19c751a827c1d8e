# ruff: noqa  (the second NF4 kernel as committed in 56db9a9 and restructured in 0e98069, kept to be measured beside the fourth)
"""NF4 -> e4m3 in one pass, into [N, K] or its transpose (jobs/training/fp8_nf4.py says why and what it computes).

One program takes BLOCK_N rows x BLOCK_K columns of the [N, K] weight as [BLOCK_N, BLOCK_K / blocksize, blocksize / 2]
packed bytes, each read once: the absmax (nested: code2[byte] * absmax2 + offset) is computed once per block of
`blocksize` values, not per value; each byte's two nibbles go through the code table, times their block's absmax,
rounded to bf16 as bitsandbytes does, joined back into column order (the even-indexed value is the high nibble) and
cast over the row's scale to e4m3 with the quantisation kernel's exact rounding (`_to_e4m3`). The output is addressed
by strides, so the same kernel writes the forward's row-major [N, K] and the input gradient's [K, sum N] column slice.
Compiled without floating-point contraction: a fused multiply-add would round code2 * absmax2 + offset differently
from bitsandbytes' two operations. A weight whose rows are not whole absmax blocks (K % blocksize != 0: no
architecture in jobs/training/arch_specs.py has such a K: all are multiples of 64) takes the eager path. Triton is
imported when the kernel is first defined (`_jit`), so that a machine without it imports this module.

Speed (results/h200-2026-11-26/nf4-storage/, Qwen3-32B's 25,600 x 5,120 on one H200): 0.39 ms forward, 0.43 ms
transposed, ~500 GB/s over the 1.5 bytes a value moves, against bitsandbytes' NF4 -> bf16 at ~2,000 GB/s: the
per-value arithmetic (code lookup, bf16 rounding, IEEE division, exact e4m3 rounding) bounds it, not memory. Taking
the absmax once per block instead of once per value made it 2.5x faster than the first version (~200 GB/s); the
card's own e4m3x2 conversion with 16-bit stores made it slower (186 / 377 GB/s).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from jobs.training.fp8_format import FMAX
from jobs.training.fp8_nf4 import NF4Source, nf4_to_fp8_ref

BLOCK_N, BLOCK_K = 32, 256


@functools.cache
def _jit() -> Any:
    """The Triton kernel, defined on first use. Its names resolve as module globals (Triton reads a kernel's globals),
    hence the `global` statement: the imports bind them here, not at import time."""
    global tl, _to_e4m3
    import triton
    import triton.language as tl

    from jobs.training import fp8_quant_kernel

    fp8_quant_kernel._jit()  # defines its `_to_e4m3`, which this kernel calls
    _to_e4m3 = fp8_quant_kernel._to_e4m3

    @triton.jit
    def nf4_to_e4m3(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, scale_ptr, out_ptr, n_rows,
                    n_cols, out_stride_n, out_stride_k, fmax, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                    NESTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        NB: tl.constexpr = BLOCK_K // BLOCKSIZE
        HALF: tl.constexpr = BLOCKSIZE // 2
        rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1).to(tl.int64) * BLOCK_K
        rb = tl.arange(0, NB)
        rj = tl.arange(0, HALF)
        row_ok = rn < n_rows
        blk_ok = row_ok[:, None] & (k0 + rb[None, :] * BLOCKSIZE < n_cols)  # [BLOCK_N, NB]
        block = (rn[:, None] * n_cols + k0) // BLOCKSIZE + rb[None, :]  # absmax index of each (row, block)
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=blk_ok, other=0).to(tl.int32)
            amax = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=blk_ok, other=0.0) + offset
        else:
            amax = tl.load(absmax_ptr + block, mask=blk_ok, other=0.0)
        byte_at = block[:, :, None] * HALF + rj[None, None, :]  # [BLOCK_N, NB, HALF]
        ok3 = blk_ok[:, :, None] & (rj[None, None, :] < HALF)
        byte = tl.load(packed_ptr + byte_at, mask=ok3, other=0).to(tl.int32)
        a3 = amax[:, :, None]
        hi = (tl.load(code_ptr + (byte >> 4)) * a3).to(tl.bfloat16).to(tl.float32)
        lo = (tl.load(code_ptr + (byte & 15)) * a3).to(tl.bfloat16).to(tl.float32)
        w = tl.reshape(tl.join(hi, lo), (BLOCK_N, BLOCK_K))  # column order: byte j holds columns 2j (hi), 2j + 1 (lo)
        s = tl.load(scale_ptr + rn, mask=row_ok, other=1.0)
        q8 = _to_e4m3(w, s[:, None], fmax)
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (rk[None, :] < n_cols)
        tl.store(out_ptr + rn[:, None] * out_stride_n + rk[None, :] * out_stride_k, q8, mask=mask)

    return nf4_to_e4m3


def nf4_to_fp8(src: NF4Source, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`nf4_to_fp8_ref` on CUDA: `out` any [N, K] view of e4m3 (the weight, or `t.t()` of a transposed slice)."""
    n, k = src.shape
    if tuple(out.shape) != (n, k):
        raise ValueError(f"out is {tuple(out.shape)}, the weight {n}x{k}")
    if k % src.blocksize or BLOCK_K % src.blocksize:
        return nf4_to_fp8_ref(src, scale, out)
    if n == 0 or k == 0:
        return out
    nested = (src.absmax2, src.code2, src.offset) if src.nested else (src.code, src.code, 0.0)
    grid = (-(-n // BLOCK_N), -(-k // BLOCK_K))
    _jit()[grid](src.packed, src.absmax, src.code, nested[0], nested[1], nested[2], scale, out, n, k,
                    out.stride(0), out.stride(1), FMAX, BLOCKSIZE=src.blocksize,
                    BLOCKSIZE2=src.blocksize2 if src.nested else 1, NESTED=src.nested, BLOCK_N=BLOCK_N,
                    BLOCK_K=BLOCK_K, num_warps=8, enable_fp_fusion=False)
    return out
