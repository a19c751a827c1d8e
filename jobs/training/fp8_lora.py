"""LoRA over FP8 frozen bases, fused the way Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP are (issue 16).

Each Function computes out = x W^T + S (x A^T) B^T per projection with the base term on FP8
(jobs/training/fp8.py: one quantisation of x per group, fast-accumulation forward) and the LoRA term in
the activations' dtype; backward: the base input gradient is one FP8 GEMM per group with the weight
scales folded into dy, the LoRA gradients (in the weights' dtype) and their share of dx from bf16 GEMMs.
A group's LoRA products that read the same x (q, k, v; gate, up) are one GEMM each (x A^T, dA, dx's
LoRA share) instead of one per projection — an 8B step on an H200 ran 4.7 % / 4.9 % faster
(results/h200-2026-11-26/fp8-lora-grouped/). Each product is added into its [M, N] output by `lora_add_`
(a Triton kernel for large outputs, addmm_ otherwise).

Saved for backward: what Unsloth saves (x; for the MLP x, e, g), and per group x A^T [M, sum r] and the LoRA
weights cast to the activations' dtype (PEFT keeps them fp32: its autocast_adapter_dtype). So the backward neither
recomputes x A^T nor casts a weight, and cuBLAS writes the fp32 gradients itself: an 8B step made 3,342 launch
calls instead of 4,910 (results/h200-2026-11-26/fp8-launches/). Memory: 7 KB a token more by arithmetic; the
bench's memory line read 3.632 / 3.643 MB a token against 3.627 / 3.639 before.

Plain LoRA only (one adapter, no dropout, no lora bias, no DoRA): the callers (jobs/training/fp8_unsloth.py)
hand anything else back to Unsloth. Device-agnostic: on the CPU the scaled matmuls are emulated, which
is how tests check the gradients against a dense reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from jobs.training.fp8 import STATS, FP8Group, fp8_dgrad, fp8_forward, lora_add_, quant_x

_fwd = torch.amp.custom_fwd(device_type="cuda")
_bwd = torch.amp.custom_bwd(device_type="cuda")
Tensor = torch.Tensor


def _weights(As: Sequence[Tensor], Bs: Sequence[Tensor], dt: torch.dtype) -> tuple[Tensor, list[int], list[Tensor]]:
    """([A_1; A_2; ...] [sum r_i, K], the ranks, each B_i) in the activations' dtype, made once in the forward and
    saved for the backward: PEFT keeps LoRA weights in fp32 (autocast_adapter_dtype), and casting them at each use
    (forward and backward) was ~25 launches a layer, counted from the code."""
    a_cat = (As[0] if len(As) == 1 else torch.cat(list(As))).to(dt)
    return a_cat, [a.shape[0] for a in As], [b.to(dt) for b in Bs]


def _lora_add(outs: Sequence[Tensor], x2: Tensor, a_cat: Tensor, ranks: Sequence[int], bs: Sequence[Tensor],
              scales: Sequence[float]) -> Tensor:
    """outs[i] [M, N_i] += s_i (x A_i^T) B_i^T; returns x [A_1; A_2; ...]^T [M, sum r_i] (one GEMM: x is read
    once, not once per projection), which the backward reuses for dB."""
    xa = x2 @ a_cat.t()
    for out, xa_i, b, s in zip(outs, xa.split(list(ranks), dim=1), bs, scales, strict=True):
        lora_add_(out, xa_i, b, s)
    return xa


def _lora_grads(dys: Sequence[Tensor], x2: Tensor, xa: Tensor, a_cat: Tensor, ranks: Sequence[int],
                bs: Sequence[Tensor], scales: Sequence[float], dx: Tensor, dtype: torch.dtype
                ) -> tuple[list[Tensor], list[Tensor]]:
    """(dA_i, dB_i) in `dtype` (the LoRA weights') for out_i = x W_i^T + s_i (x A_i^T) B_i^T, and dx += sum_i
    s_i (dy_i B_i) A_i. Over the group, dA and dx's LoRA share are one GEMM each; dB_i stays one per
    projection (its dy_i is its own) and reads the forward's x A^T."""
    y_b = x2.new_empty(x2.shape[0], sum(ranks))  # each s_i dy_i B_i written into its columns: no cat
    for dy, b, s, part in zip(dys, bs, scales, y_b.split(list(ranks), dim=1), strict=True):
        _scale(torch.mm(dy, b, out=part), s)
    da = list(grad_mm(y_b.t(), x2, 1.0, dtype).split(list(ranks)))  # s_i (dy_i B_i)^T x
    lora_add_(dx, y_b, a_cat, 1.0, b_rows_are_rank=True)
    db = [grad_mm(dy.t(), xa_i, s, dtype) for dy, xa_i, s in zip(dys, xa.split(list(ranks), dim=1), scales,
                                                                  strict=True)]
    return da, db


def _scale(t: Tensor, s: float) -> Tensor:
    """t *= s in place, skipped for LoRA's usual s = alpha / r = 1 (one launch fewer, same result)."""
    return t if s == 1.0 else t.mul_(s)


def grad_mm(a: Tensor, b: Tensor, s: float, dtype: torch.dtype) -> Tensor:
    """s a @ b in `dtype`, a LoRA weight's gradient: where the weights are fp32 and the operands bf16 (fp16), cuBLAS
    writes fp32 itself on CUDA (no bf16 rounding of the gradient, no cast launch by autograd); elsewhere the
    product is cast."""
    if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        return _scale(torch.mm(a, b, out_dtype=torch.float32), s)
    return _scale((a @ b).to(dtype), s)


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


class FP8LoraQKV(torch.autograd.Function):
    """Q, K, V = x Wq^T + LoRA, x Wk^T + LoRA, x Wv^T + LoRA; the group holds (q, k, v)."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, group: FP8Group, qa: Tensor, qb: Tensor, qs: float, ka: Tensor, kb: Tensor,
                ks: float, va: Tensor, vb: Tensor, vs: float) -> tuple[Tensor, Tensor, Tensor]:
        x2 = _flat(x)
        xq, sx = quant_x(x2)
        outs = [fp8_forward(xq, sx, base, x.dtype) for base in group.bases]
        a_cat, ranks, bs = _weights((qa, ka, va), (qb, kb, vb), x.dtype)
        xa = _lora_add(outs, x2, a_cat, ranks, bs, (qs, ks, vs))
        outs = [o.view(*x.shape[:-1], base.out_features) for o, base in zip(outs, group.bases, strict=True)]
        ctx.save_for_backward(x, xa, a_cat, *bs)
        ctx.group, ctx.scales, ctx.ranks, ctx.dtype = group, (qs, ks, vs), ranks, qa.dtype
        STATS.bump(STATS.fp8_calls, "qkv")
        return outs[0], outs[1], outs[2]

    @staticmethod
    @_bwd
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Any, ...]:
        x, xa, a_cat, *bs = ctx.saved_tensors
        x2 = _flat(x)
        dys = [(_flat(d) if d is not None else x2.new_zeros(x2.shape[0], base.out_features))
               for d, base in zip((dq, dk, dv), ctx.group.bases, strict=True)]
        dx = fp8_dgrad(dys, ctx.group, x.dtype)
        das, dbs = _lora_grads(dys, x2, xa, a_cat, ctx.ranks, bs, ctx.scales, dx, ctx.dtype)
        grads: list[Any] = []
        for da, db in zip(das, dbs, strict=True):
            grads += [da, db, None]
        return (dx.view(x.shape), None, *grads)


class FP8LoraW(torch.autograd.Function):
    """One projection (o_proj): y = x W^T + s (x A^T) B^T; the group holds the one base."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, group: FP8Group, a: Tensor, b: Tensor, s: float) -> Tensor:
        x2 = _flat(x)
        xq, sx = quant_x(x2)
        (base,) = group.bases
        y = fp8_forward(xq, sx, base, x.dtype)
        a_, ranks, bs = _weights((a,), (b,), x.dtype)
        xa = _lora_add((y,), x2, a_, ranks, bs, (s,))
        ctx.save_for_backward(x, xa, a_, *bs)
        ctx.group, ctx.s, ctx.ranks, ctx.dtype = group, s, ranks, a.dtype
        STATS.bump(STATS.fp8_calls, "o")
        return y.view(*x.shape[:-1], base.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, xa, a_, b_ = ctx.saved_tensors
        x2, dy2 = _flat(x), _flat(dy)
        dx = fp8_dgrad((dy2,), ctx.group, x.dtype)
        (da,), (db,) = _lora_grads((dy2,), x2, xa, a_, ctx.ranks, (b_,), (ctx.s,), dx, ctx.dtype)
        return dx.view(x.shape), None, da, db, None


Swiglu = Callable[[Tensor, Tensor], Tensor]
SwigluBackward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


class FP8LoraMLP(torch.autograd.Function):
    """out = down(swiglu(gate(x), up(x))), each projection FP8 base + LoRA.

    `gate_up` holds (up, gate) — the order of [df | de] in the input gradient's one GEMM —, `down` the
    down projection. `fwd(e, g)` -> h for e, g [b, s, I]; `bwd(dh, e, g)` -> (h, df, de), written into
    its arguments (Unsloth's swiglu kernels, or the reference versions below)."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, gate_up: FP8Group, down: FP8Group, ga: Tensor, gb: Tensor, gs: float,
                ua: Tensor, ub: Tensor, us: float, da: Tensor, db: Tensor, ds: float, fwd: Swiglu,
                bwd: SwigluBackward) -> Tensor:
        x2 = _flat(x)
        dt = x.dtype
        xq, sx = quant_x(x2)
        up, gate = gate_up.bases
        e = fp8_forward(xq, sx, gate, dt)
        g = fp8_forward(xq, sx, up, dt)
        gu_a, gu_ranks, gu_bs = _weights((ga, ua), (gb, ub), dt)
        xa = _lora_add((e, g), x2, gu_a, gu_ranks, gu_bs, (gs, us))
        h = _flat(fwd(e.view(1, -1, e.shape[-1]), g.view(1, -1, g.shape[-1])))
        hq, sh = quant_x(h)
        (dbase,) = down.bases
        out = fp8_forward(hq, sh, dbase, dt)
        d_a, d_ranks, (d_b,) = _weights((da,), (db,), dt)
        ha = _lora_add((out,), h, d_a, d_ranks, (d_b,), (ds,))
        ctx.save_for_backward(x, e, g, xa, ha, gu_a, *gu_bs, d_a, d_b)
        ctx.groups, ctx.scales, ctx.bwd, ctx.ranks, ctx.dtype = (gate_up, down), (gs, us, ds), bwd, gu_ranks, ga.dtype
        STATS.bump(STATS.fp8_calls, "mlp")
        return out.view(*x.shape[:-1], dbase.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, e, g, xa, ha, gu_a, gb_, ub_, d_a, d_b = ctx.saved_tensors
        gate_up, down = ctx.groups
        gs, us, ds = ctx.scales
        x2, dy2 = _flat(x), _flat(dy).contiguous()
        dt = x.dtype
        dh = fp8_dgrad((dy2,), down, dt)  # dy Wd
        # down's LoRA by hand, not _lora_grads: dx's share goes into dh before the SwiGLU backward, its dA
        # needs h, which that backward writes into dh afterwards
        y_bd = dy2 @ d_b
        lora_add_(dh, y_bd, d_a, ds, b_rows_are_rank=True)
        h, df, de = ctx.bwd(dh, e, g)  # in place: dh <- h, e <- df (grad of up), g <- de (grad of gate)
        d_da = grad_mm(y_bd.t(), h, ds, ctx.dtype)
        d_db = grad_mm(dy2.t(), ha, ds, ctx.dtype)
        dx = fp8_dgrad((df, de), gate_up, dt)
        (d_ga, d_ua), (d_gb, d_ub) = _lora_grads((de, df), x2, xa, gu_a, ctx.ranks, (gb_, ub_), (gs, us), dx,
                                                 ctx.dtype)
        return (dx.view(x.shape), None, None, d_ga, d_gb, None, d_ua, d_ub, None, d_da, d_db, None, None, None)


def swiglu_forward_ref(e: Tensor, g: Tensor) -> Tensor:
    """h = silu(e) * g with Unsloth's rounding (silu in fp32, cast, times g)."""
    ef = e.float()
    return (ef * torch.sigmoid(ef)).to(g.dtype) * g


def swiglu_backward_ref(dh: Tensor, e: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unsloth's swiglu_DWf_DW_dfg_kernel contract in torch: returns (h, df, de), written into (dh, e, g)."""
    ef = e.float()
    se = torch.sigmoid(ef)
    f = (se * ef).to(dh.dtype)
    h, df = f * g, dh * f
    de = ((dh * g).float() * se * (1.0 + ef * (1.0 - se))).to(dh.dtype)
    dh.copy_(h)
    e.copy_(df)
    g.copy_(de)
    return dh, e, g
