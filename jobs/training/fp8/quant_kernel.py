"""The per-row FP8 quantisation as one Triton kernel (issue 16).

Inductor compiled `quant_rows_ref` into two kernels (an amax reduction, then a scale/cast pass), each
reading the whole bf16 input from memory at ~0.6 TB/s on the H200 (dynamic shapes, the `cat` of the
dgrad operand indexed per element): 22 % of an FP8 step (RESULTS.md: 2026-11-23, 8B FP8 profile). Here
one program quantises one row: a first loop takes the row's amax (column scales applied), a second
re-reads the row — from L2, a row is at most tens of kB — scales, clamps and casts to e4m3. The
inputs of a concatenated row (the dgrad operand [dy_1 s_1 | dy_2 s_2 | dy_3 s_3]) are read in place:
no `cat`, no `.contiguous()` copy when the last dimension is already contiguous.

The arithmetic is `quant_rows_ref`'s on CUDA, in the same order (fp32 multiply by the column scale,
amax clamped at MIN_AMAX, scale = amax * fp32(1/448) as torch divides by a scalar, x / scale in IEEE
division, clamped to +-448, rounded once to the nearest e4m3).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import torch

from jobs.training.fp8.e4m3 import E4M3, FMAX, MIN_AMAX

MAX_INPUTS = 3
# torch divides by a Python scalar as a multiply by its fp32 reciprocal (the reference's amax / 448):
# the kernel takes the same fp32 value so that the scales are identical.
INV_FMAX = struct.unpack("f", struct.pack("f", 1.0 / FMAX))[0]


@functools.cache
def _jit() -> Any:
    """The kernels, defined on first use: Triton is imported here, so that a machine without it imports this module;
    the `global` statement makes the jit functions module globals, where Triton resolves the names a kernel calls."""
    global tl, _to_e4m3, _load_scaled, _segment_amax, _segment_cast
    import triton
    import triton.language as tl

    @triton.jit
    def _to_e4m3(v, s, fmax):
        """v / s clamped to +-fmax, rounded to the e4m3 grid in fp32 (nearest, ties to even), then cast.

        Triton's own fp32 -> e4m3 cast rounds twice, as through fp16 (seen on the H100 with Triton 3.6:
        167.99998 -> 176, where torch gives 160); a value already on the e4m3 grid casts exactly. Normal
        e4m3 keeps 3 of fp32's 23 mantissa bits; below 2^-6 the grid is multiples of 2^-9 (rounded by
        adding 1.5 * 2^14)."""
        x = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -fmax), fmax)
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        ax = tl.abs(x)
        tiny = (ax + 24576.0) - 24576.0
        tiny = (tiny.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(ax >= 0.015625, normal, tiny).to(tl.float8e4nv)


    @triton.jit
    def _load_scaled(ptr, stride, n, sc_ptr, row, start, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr):
        """Columns [start, start + BLOCK) of one row in fp32, times their column scales; 0 past the end."""
        cols = start + tl.arange(0, BLOCK)
        m = cols < n
        v = tl.load(ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(sc_ptr + cols, mask=m, other=0.0)
        return v


    @triton.jit
    def _segment_amax(amax, ptr, stride, n, sc_ptr, row, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr):
        for start in range(0, n, BLOCK):
            amax = tl.maximum(amax, tl.abs(_load_scaled(ptr, stride, n, sc_ptr, row, start, BLOCK, HAS_SCALE)))
        return amax


    @triton.jit
    def _segment_cast(out_ptr, out_off, ptr, stride, n, sc_ptr, row, s, fmax, BLOCK: tl.constexpr,
                      HAS_SCALE: tl.constexpr):
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = _load_scaled(ptr, stride, n, sc_ptr, row, start, BLOCK, HAS_SCALE)
            tl.store(out_ptr + out_off + cols, _to_e4m3(v, s, fmax), mask=cols < n)


    @triton.jit
    def quant_rows_amax_scale_cast(out_ptr, out_stride, scale_ptr,
                                   a_ptr, a_stride, a_n, a_sc,
                                   b_ptr, b_stride, b_n, b_sc,
                                   c_ptr, c_stride, c_n, c_sc,
                                   min_amax, inv_fmax, fmax,
                                   NUM: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                                   ONE_LOAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        out_row = row * out_stride
        if ONE_LOAD:  # one input that fits one block: read once, keep the row in registers
            cols = tl.arange(0, BLOCK)
            v = _load_scaled(a_ptr, a_stride, a_n, a_sc, row, 0, BLOCK, HAS_SCALE)
            s = tl.maximum(tl.max(tl.abs(v), axis=0), min_amax) * inv_fmax
            tl.store(scale_ptr + row, s)
            tl.store(out_ptr + out_row + cols, _to_e4m3(v, s, fmax), mask=cols < a_n)
        else:  # first the row's amax, then a second read (from L2) to scale and cast
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            amax = _segment_amax(amax, a_ptr, a_stride, a_n, a_sc, row, BLOCK, HAS_SCALE)
            if NUM >= 2:
                amax = _segment_amax(amax, b_ptr, b_stride, b_n, b_sc, row, BLOCK, HAS_SCALE)
            if NUM >= 3:
                amax = _segment_amax(amax, c_ptr, c_stride, c_n, c_sc, row, BLOCK, HAS_SCALE)
            s = tl.maximum(tl.max(amax, axis=0), min_amax) * inv_fmax
            tl.store(scale_ptr + row, s)
            _segment_cast(out_ptr, out_row, a_ptr, a_stride, a_n, a_sc, row, s, fmax, BLOCK, HAS_SCALE)
            if NUM >= 2:
                _segment_cast(out_ptr, out_row + a_n, b_ptr, b_stride, b_n, b_sc, row, s, fmax, BLOCK, HAS_SCALE)
            if NUM >= 3:
                _segment_cast(out_ptr, out_row + a_n + b_n, c_ptr, c_stride, c_n, c_sc, row, s, fmax, BLOCK,
                              HAS_SCALE)

    return quant_rows_amax_scale_cast


ONE_LOAD_MAX = 8192  # widest single input read once (measured on the H100: 4096 -> 49 us vs 75 us two-pass)


def _launch_shape(widths: Sequence[int], scaled: bool) -> tuple[int, bool]:
    """(BLOCK, ONE_LOAD) for these input widths (8 warps either way).

    Swept on one H100 (RESULTS.md: 2026-11-26, quant and LoRA-add kernels): one unscaled input of a power-of-two
    width up to 8192 is read once; a padded one (5120 in an 8192 block: 73 against 35 us at 2,560 rows) or
    a scaled one is not. Otherwise the block follows the narrowest input, whose masked tail a wide block
    wastes: q/k/v's dgrad operand [4096 | 1024 | 1024] took 177 us in 4096 blocks and 86-93 us in 1024
    ones."""
    if len(widths) == 1 and not scaled and 0 < widths[0] <= ONE_LOAD_MAX and widths[0] & (widths[0] - 1) == 0:
        return max(16, widths[0]), True
    narrowest = min(widths)
    return (1024 if narrowest < 2048 else 2048 if narrowest < 8192 else 4096), False


def quant_rows(ts: Sequence[torch.Tensor], col_scales: Sequence[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cat(t_i * s_i, dim=1) [M, sum N_i] -> (e4m3 row-major, fp32 [M, 1]); 1 to 3 inputs [M, N_i] with
    one row count, each with its last dimension contiguous (other strides are read as they are), and
    fp32 column scales [1, N_i] (contiguous)."""
    n = len(ts)
    if not 1 <= n <= MAX_INPUTS:
        raise ValueError(f"quant_rows takes 1 to {MAX_INPUTS} inputs, got {n}")
    m = ts[0].shape[0]
    ts = [t if t.stride(1) == 1 else t.contiguous() for t in ts]
    widths = [t.shape[1] for t in ts]
    out = torch.empty(m, sum(widths), dtype=E4M3, device=ts[0].device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=ts[0].device)
    if m == 0:
        return out, scale
    scs = col_scales if col_scales is not None else (scale,) * n
    args: list[object] = []
    for i in range(MAX_INPUTS):
        j = i if i < n else 0  # unused slots: any valid pointer, width 0
        args += [ts[j], ts[j].stride(0), widths[j] if i < n else 0, scs[j]]
    block, one_load = _launch_shape(widths, col_scales is not None)
    _jit()[(m,)](out, out.stride(0), scale, *args, MIN_AMAX, INV_FMAX, FMAX, NUM=n,
                                     HAS_SCALE=col_scales is not None, BLOCK=block, ONE_LOAD=one_load,
                                     num_warps=8)
    return out, scale
