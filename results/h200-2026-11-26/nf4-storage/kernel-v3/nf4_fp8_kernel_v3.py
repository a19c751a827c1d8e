# ruff: noqa  (a kernel version measured on the device, kept as it ran; not part of the package)
"""NF4 -> e4m3 in one pass, into [N, K] or its transpose (jobs/training/fp8_nf4.py says why and what it computes).

One program takes BLOCK_N rows x BLOCK_K columns of the [N, K] weight as [BLOCK_N, BLOCK_K / blocksize, blocksize / 2]
packed bytes, each read once: the absmax (nested: code2[byte] * absmax2 + offset) is computed once per block of
`blocksize` values, not per value; each byte's two nibbles go through the code table, times their block's absmax,
rounded to bf16 as bitsandbytes does, divided by the row's scale (IEEE division, as torch divides) and cast as a pair
by the card's own e4m3x2 conversion (round to nearest even once, saturated: what torch's cast of the clamped value
gives; Triton's own fp32 -> e4m3 cast rounds twice, see fp8_quant_kernel._to_e4m3). The pair is the two columns of
the byte: one 16-bit store into a row-major [N, K], two byte stores into the input gradient's [K, sum N] column slice.
Compiled without floating-point contraction: a fused multiply-add would round code2 * absmax2 + offset differently
from bitsandbytes' two operations. A weight whose rows are not whole absmax blocks (K % blocksize != 0: no model
nightshift trains) takes the eager path. Measured on one H100 (results/h100-2026-11-26/nf4-kernel/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobs.training.fp8_nf4 import NF4Source, nf4_to_fp8_ref

BLOCK_N, BLOCK_K = 32, 256


@triton.jit
def _e4m3_pair(first, second):
    """Two fp32 values to e4m3 in one instruction (sm89+: round to nearest even, once; saturated to +-448), packed
    little-endian as [first, second] in 16 bits."""
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [first, second],
                                     dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def nf4_to_e4m3(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, scale_ptr, out_ptr, n_rows, n_cols,
                out_stride_n, out_stride_k, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                NESTED: tl.constexpr, ROW_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    ok3 = blk_ok[:, :, None] & (rj[None, None, :] < HALF)
    byte = tl.load(packed_ptr + block[:, :, None] * HALF + rj[None, None, :], mask=ok3, other=0).to(tl.int32)
    a3 = amax[:, :, None]
    s3 = tl.load(scale_ptr + rn, mask=row_ok, other=1.0)[:, None, None]
    even = tl.math.div_rn((tl.load(code_ptr + (byte >> 4)) * a3).to(tl.bfloat16).to(tl.float32), s3)
    odd = tl.math.div_rn((tl.load(code_ptr + (byte & 15)) * a3).to(tl.bfloat16).to(tl.float32), s3)
    pair = _e4m3_pair(even, odd)  # columns 2j (the byte's high nibble) and 2j + 1
    col = k0 + rb[None, :, None] * BLOCKSIZE + 2 * rj[None, None, :]  # [1, NB, HALF]: the even column
    if ROW_MAJOR:  # both bytes side by side: one 16-bit store
        dst = (out_ptr + rn[:, None, None] * out_stride_n + col).to(tl.pointer_type(tl.int16), bitcast=True)
        tl.store(dst, pair, mask=ok3)
    else:
        dst = (out_ptr + rn[:, None, None] * out_stride_n + col * out_stride_k).to(tl.pointer_type(tl.uint8),
                                                                                 bitcast=True)
        tl.store(dst, (pair & 255).to(tl.uint8), mask=ok3)
        tl.store(dst + out_stride_k, ((pair >> 8) & 255).to(tl.uint8), mask=ok3)


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
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
    row_major = out.stride(1) == 1 and out.stride(0) % 2 == 0 and out.data_ptr() % 2 == 0
    nf4_to_e4m3[grid](src.packed, src.absmax, src.code, nested[0], nested[1], nested[2], scale, out, n, k,
                      out.stride(0), out.stride(1), BLOCKSIZE=src.blocksize,
                      BLOCKSIZE2=src.blocksize2 if src.nested else 1, NESTED=src.nested, ROW_MAJOR=row_major,
                      BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=8, enable_fp_fusion=False)
    return out
