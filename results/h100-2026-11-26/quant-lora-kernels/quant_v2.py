# ruff: noqa  (draft of the multi-row quantisation kernel, swept on the device before it replaces the one-row kernel)
import torch
import triton
import triton.language as tl

from jobs.training.fp8_format import E4M3, FMAX, MIN_AMAX
from jobs.training.fp8_quant_kernel import INV_FMAX, _to_e4m3


@triton.jit
def _load_rows(ptr, stride, n, sc_ptr, rows, rmask, start, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    cm = cols < n
    v = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
    v = v.to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(sc_ptr + cols, mask=cm, other=0.0)[None, :]
    return v


@triton.jit
def _store_rows(out_ptr, out_stride, out_off, n, rows, rmask, start, v, s, fmax, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    tl.store(out_ptr + rows[:, None] * out_stride + out_off + cols[None, :], _to_e4m3(v, s[:, None], fmax),
             mask=rmask[:, None] & (cols < n)[None, :])


@triton.jit
def _seg_amax(amax, ptr, stride, n, sc_ptr, rows, rmask, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr):
    for start in range(0, n, BLOCK):
        v = _load_rows(ptr, stride, n, sc_ptr, rows, rmask, start, BLOCK, HAS_SCALE)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def _seg_cast(out_ptr, out_stride, out_off, ptr, stride, n, sc_ptr, rows, rmask, s, fmax, BLOCK: tl.constexpr,
              HAS_SCALE: tl.constexpr):
    for start in range(0, n, BLOCK):
        v = _load_rows(ptr, stride, n, sc_ptr, rows, rmask, start, BLOCK, HAS_SCALE)
        _store_rows(out_ptr, out_stride, out_off, n, rows, rmask, start, v, s, fmax, BLOCK)


@triton.jit
def quant_rows_kernel(out_ptr, out_stride, scale_ptr, m,
                      a_ptr, a_stride, a_n, a_sc, b_ptr, b_stride, b_n, b_sc, c_ptr, c_stride, c_n, c_sc,
                      min_amax, inv_fmax, fmax,
                      NUM: tl.constexpr, HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, IN_REGS: tl.constexpr,
                      BA: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < m
    if IN_REGS:  # every segment one block, read once, kept in registers
        va = _load_rows(a_ptr, a_stride, a_n, a_sc, rows, rmask, 0, BA, HAS_SCALE)
        amax = tl.max(tl.abs(va), axis=1)
        if NUM >= 2:
            vb = _load_rows(b_ptr, b_stride, b_n, b_sc, rows, rmask, 0, BB, HAS_SCALE)
            amax = tl.maximum(amax, tl.max(tl.abs(vb), axis=1))
        if NUM >= 3:
            vc = _load_rows(c_ptr, c_stride, c_n, c_sc, rows, rmask, 0, BC, HAS_SCALE)
            amax = tl.maximum(amax, tl.max(tl.abs(vc), axis=1))
        s = tl.maximum(amax, min_amax) * inv_fmax
        tl.store(scale_ptr + rows, s, mask=rmask)
        _store_rows(out_ptr, out_stride, 0, a_n, rows, rmask, 0, va, s, fmax, BA)
        if NUM >= 2:
            _store_rows(out_ptr, out_stride, a_n, b_n, rows, rmask, 0, vb, s, fmax, BB)
        if NUM >= 3:
            _store_rows(out_ptr, out_stride, a_n + b_n, c_n, rows, rmask, 0, vc, s, fmax, BC)
    else:  # the rows' amax over chunks, then a second read (from L2) to scale and cast
        amax = tl.zeros([ROWS], dtype=tl.float32)
        amax = _seg_amax(amax, a_ptr, a_stride, a_n, a_sc, rows, rmask, BLOCK, HAS_SCALE)
        if NUM >= 2:
            amax = _seg_amax(amax, b_ptr, b_stride, b_n, b_sc, rows, rmask, BLOCK, HAS_SCALE)
        if NUM >= 3:
            amax = _seg_amax(amax, c_ptr, c_stride, c_n, c_sc, rows, rmask, BLOCK, HAS_SCALE)
        s = tl.maximum(amax, min_amax) * inv_fmax
        tl.store(scale_ptr + rows, s, mask=rmask)
        _seg_cast(out_ptr, out_stride, 0, a_ptr, a_stride, a_n, a_sc, rows, rmask, s, fmax, BLOCK, HAS_SCALE)
        if NUM >= 2:
            _seg_cast(out_ptr, out_stride, a_n, b_ptr, b_stride, b_n, b_sc, rows, rmask, s, fmax, BLOCK, HAS_SCALE)
        if NUM >= 3:
            _seg_cast(out_ptr, out_stride, a_n + b_n, c_ptr, c_stride, c_n, c_sc, rows, rmask, s, fmax, BLOCK,
                      HAS_SCALE)


def quant_rows_v2(ts, col_scales=None, *, rows=4, in_regs=True, block=2048, warps=8):
    n = len(ts)
    m = ts[0].shape[0]
    ts = [t if t.stride(1) == 1 else t.contiguous() for t in ts]
    widths = [t.shape[1] for t in ts]
    out = torch.empty(m, sum(widths), dtype=E4M3, device=ts[0].device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=ts[0].device)
    if m == 0:
        return out, scale
    scs = col_scales if col_scales is not None else (scale,) * n
    args = []
    blocks = []
    for i in range(3):
        j = i if i < n else 0
        args += [ts[j], ts[j].stride(0), widths[j] if i < n else 0, scs[j]]
        blocks.append(max(16, triton.next_power_of_2(widths[j])) if i < n else 16)
    quant_rows_kernel[(triton.cdiv(m, rows),)](out, out.stride(0), scale, m, *args, MIN_AMAX, INV_FMAX, FMAX, NUM=n,
                                               HAS_SCALE=col_scales is not None, ROWS=rows, IN_REGS=in_regs,
                                               BA=blocks[0], BB=blocks[1], BC=blocks[2], BLOCK=block,
                                               num_warps=warps)
    return out, scale
