"""NF4 -> e4m3 in one pass, into [N, K] or its transpose (jobs/training/fp8/nf4.py says why and what it computes).

A block of `blocksize` values shares one absmax and a row shares one scale, so each (row, block) has only 16 possible
e4m3 bytes: code[c] * absmax rounded to bf16 as bitsandbytes does, divided by the row's scale (IEEE division), rounded
with the quantisation kernel's exact e4m3 rounding (`_to_e4m3`). One program takes BLOCK_N rows x BLOCK_K columns,
computes those 16-entry tables (16 values of arithmetic per block instead of `blocksize`), holds each as four 32-bit
words, and looks every nibble up with the card's byte permute (`prmt`, two per four values and one more for the
select of the table's upper half): the per-value work is a few integer instructions, so the pass runs at memory speed.
The packed bytes are read as 32-bit words (eight values; the even-indexed value is a byte's high nibble); the output
is written as 32-bit words into a row-major [N, K] (the forward), byte by byte through its strides into the input
gradient's [K, sum N] column slice. Compiled without floating-point contraction: a fused multiply-add would round
code2 * absmax2 + offset differently from bitsandbytes' two operations. A weight whose rows are not whole absmax
blocks (K % blocksize != 0: no architecture in jobs/training/models/specs.py has one), or packed bytes not 4-byte
aligned, takes the eager path. Triton is imported when the kernel is first defined (`_jit`), so that a machine without
it imports this module.

Speed (RESULTS.md: 2026-11-26, NF4 lookup kernel; Qwen3-32B's 25,600 x 5,120 on one H200): 0.122 ms forward,
0.150 ms transposed (1,608 / 1,307 GB/s over the 1.5 bytes a value moves), against 0.392 / 0.423 ms for the previous
version, which did the whole arithmetic per value (RESULTS.md: 2026-11-26, NF4 storage v2); none of six other
tile shapes measured was faster for both outputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from jobs.training.fp8.e4m3 import FMAX
from jobs.training.fp8.nf4 import NF4Source, nf4_to_fp8_ref

BLOCK_N, BLOCK_K, NUM_WARPS = 32, 256, 8


def _lookup_ptx() -> str:
    """One 32-bit word of packed NF4 ($2: eight values, two a byte, the even-indexed one in the high nibble) through a
    16-entry byte table ($3..$6: entries 0-3, 4-7, 8-11, 12-15) into eight e4m3 bytes in column order ($0: values 0-3,
    $1: 4-7). prmt picks 4 bytes out of 8 by the low 3 bits of each selector nibble; bit 3 picks the table's half,
    through a byte mask made by a third prmt from {0, 0xFFFFFFFF}."""

    def four(out: str) -> str:  # the values whose nibbles are the low 16 bits of `sel`, into `out`
        return ("and.b32 low3, sel, 0x7777;\nshr.b32 half, sel, 1;\nand.b32 half, half, 0x4444;\n"
                "prmt.b32 lo, $3, $4, low3;\nprmt.b32 hi, $5, $6, low3;\nprmt.b32 msk, zero, ones, half;\n"
                f"and.b32 hi, hi, msk;\nnot.b32 msk, msk;\nand.b32 lo, lo, msk;\nor.b32 {out}, lo, hi;\n")

    return ("\n{\n.reg .b32 ns, nb, sel, low3, half, msk, lo, hi, zero, ones;\nmov.b32 zero, 0;\n"
            "mov.b32 ones, 0xFFFFFFFF;\nshr.b32 ns, $2, 4;\nand.b32 ns, ns, 0x0F0F0F0F;\nshl.b32 nb, $2, 4;\n"
            "and.b32 nb, nb, 0xF0F0F0F0;\nor.b32 sel, ns, nb;\n"  # nibble k of sel: value k
            + four("$0") + "shr.b32 sel, sel, 16;\n" + four("$1") + "}\n")


LOOKUP_PTX = _lookup_ptx()


@functools.cache
def _jit() -> Any:
    """The Triton kernel, defined on first use. Its names resolve as module globals (Triton reads a kernel's globals),
    hence the `global` statement: the imports bind them here, not at import time."""
    global tl, _to_e4m3, _table_word, _LOOKUP
    import triton
    import triton.language as tl

    from jobs.training.fp8 import quant_kernel as fp8_quant_kernel

    fp8_quant_kernel._jit()  # defines its `_to_e4m3`, which this kernel calls
    _to_e4m3 = fp8_quant_kernel._to_e4m3
    _LOOKUP = tl.constexpr(LOOKUP_PTX)  # a kernel reads only constexpr globals

    @triton.jit
    def _table_word(code_ptr, W: tl.constexpr, amax, s, fmax):
        """Entries 4W .. 4W + 3 of each (row, block)'s table [BLOCK_N, NB] as one int32, entry 4W + i in byte i."""
        i = tl.arange(0, 4)
        v = (tl.load(code_ptr + 4 * W + i)[None, None, :] * amax[:, :, None]).to(tl.bfloat16).to(tl.float32)
        q = _to_e4m3(v, s[:, :, None], fmax).to(tl.uint8, bitcast=True).to(tl.int32)
        return tl.sum(q << (8 * i)[None, None, :], axis=2)

    @triton.jit
    def nf4_to_e4m3(packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, scale_ptr, out_ptr, n_rows,
                    n_cols, out_stride_n, out_stride_k, fmax, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                    NESTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
        NB: tl.constexpr = BLOCK_K // BLOCKSIZE
        WB: tl.constexpr = BLOCKSIZE // 8  # packed 32-bit words a block
        rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1).to(tl.int64) * BLOCK_K
        rb = tl.arange(0, NB)
        row_ok = rn < n_rows
        blk_ok = row_ok[:, None] & (k0 + rb[None, :] * BLOCKSIZE < n_cols)  # [BLOCK_N, NB]
        block = (rn[:, None] * n_cols + k0) // BLOCKSIZE + rb[None, :]  # absmax index of each (row, block)
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=blk_ok, other=0).to(tl.int32)
            amax = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=blk_ok, other=0.0) + offset
        else:
            amax = tl.load(absmax_ptr + block, mask=blk_ok, other=0.0)
        s = tl.load(scale_ptr + rn, mask=row_ok, other=1.0)[:, None]
        t0 = _table_word(code_ptr, 0, amax, s, fmax)[:, :, None]
        t1 = _table_word(code_ptr, 1, amax, s, fmax)[:, :, None]
        t2 = _table_word(code_ptr, 2, amax, s, fmax)[:, :, None]
        t3 = _table_word(code_ptr, 3, amax, s, fmax)[:, :, None]
        word_at = block[:, :, None] * WB + tl.arange(0, WB)[None, None, :]  # [BLOCK_N, NB, WB]
        words = tl.load(packed_ptr.to(tl.pointer_type(tl.int32)) + word_at, mask=blk_ok[:, :, None], other=0)
        lo, hi = tl.inline_asm_elementwise(_LOOKUP, "=r,=r,r,r,r,r,r", [words, t0, t1, t2, t3],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        out4 = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 4))  # four e4m3 bytes a word, column order
        if WORDS:  # row-major [N, K]
            rk4 = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            mask = row_ok[:, None] & (rk4[None, :] < n_cols // 4)
            tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * (out_stride_n // 4) + rk4[None, :], out4,
                     mask=mask)
        else:  # any strides: byte by byte (join's new axis is the last: bytes 0, 2 | 1, 3 interleave to 0, 1, 2, 3)
            b = tl.join(tl.join(out4 & 255, (out4 >> 16) & 255), tl.join((out4 >> 8) & 255, (out4 >> 24) & 255))
            q8 = tl.reshape(b, (BLOCK_N, BLOCK_K)).to(tl.uint8)
            rk = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (rk[None, :] < n_cols)
            tl.store(out_ptr + rn[:, None] * out_stride_n + rk[None, :] * out_stride_k, q8, mask=mask)

    return nf4_to_e4m3


def nf4_to_fp8(src: NF4Source, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`nf4_to_fp8_ref` on CUDA: `out` any [N, K] view of e4m3 (the weight, or `t.t()` of a transposed slice)."""
    n, k = src.shape
    if tuple(out.shape) != (n, k):
        raise ValueError(f"out is {tuple(out.shape)}, the weight {n}x{k}")
    if k % src.blocksize or BLOCK_K % src.blocksize or src.blocksize % 8 or src.packed.data_ptr() % 4:
        return nf4_to_fp8_ref(src, scale, out)
    if n == 0 or k == 0:
        return out
    words = out.stride(1) == 1 and out.stride(0) % 4 == 0 and out.data_ptr() % 4 == 0
    nested = (src.absmax2, src.code2, src.offset) if src.nested else (src.code, src.code, 0.0)
    grid = (-(-n // BLOCK_N), -(-k // BLOCK_K))
    _jit()[grid](src.packed, src.absmax, src.code, nested[0], nested[1], nested[2], scale, out.view(torch.uint8), n, k,
                 out.stride(0), out.stride(1), FMAX, BLOCKSIZE=src.blocksize,
                 BLOCKSIZE2=src.blocksize2 if src.nested else 1, NESTED=src.nested, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                 WORDS=words, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
