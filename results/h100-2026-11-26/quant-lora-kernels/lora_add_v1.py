# ruff: noqa  (draft of the LoRA expand-and-add kernel, swept on the device before it replaces addmm_)
import torch
import triton
import triton.language as tl


@triton.jit
def lora_add_kernel(out_ptr, out_stride, xa_ptr, xa_stride, b_ptr, b_sn, b_sr, m, n, r, alpha,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rr = tl.arange(0, BR)
    mm, nm, rmk = rm < m, rn < n, rr < r
    xa = tl.load(xa_ptr + rm[:, None] * xa_stride + rr[None, :], mask=mm[:, None] & rmk[None, :], other=0.0)
    bt = tl.load(b_ptr + rn[None, :] * b_sn + rr[:, None] * b_sr, mask=rmk[:, None] & nm[None, :], other=0.0)
    acc = tl.dot(xa, bt.to(xa.dtype))
    ptrs = out_ptr + rm[:, None] * out_stride + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    o = tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
    tl.store(ptrs, (o + alpha * acc).to(out_ptr.dtype.element_ty), mask=msk)


def lora_add(out, xa, b, alpha, *, bm=64, bn=128, warps=4, b_t=False):
    """out [M, N] += alpha * xa [M, r] @ b^T, b [N, r] (or, b_t, b [r, N])."""
    m, n = out.shape
    r = xa.shape[1]
    sn, sr = (b.stride(1), b.stride(0)) if b_t else (b.stride(0), b.stride(1))
    br = max(16, triton.next_power_of_2(r))
    lora_add_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](out, out.stride(0), xa, xa.stride(0), b, sn, sr, m, n, r,
                                                              float(alpha), BM=bm, BN=bn, BR=br, num_warps=warps)
    return out
