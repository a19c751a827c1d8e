"""LoRA over FP8 frozen bases, fused the way Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP are (issue 16).

Each Function computes out = x W^T + S (x A^T) B^T per projection with the base term on FP8
(jobs/training/fp8.py: one quantisation of x per group, fast-accumulation forward) and the LoRA term in
the activations' dtype; backward: the base input gradient is one FP8 GEMM per group with the weight
scales folded into dy, the LoRA gradients and their share of dx in bf16. A group's LoRA products that
read the same x (q, k, v; gate, up) are one GEMM each (x A^T, dA, dx's LoRA share) instead of one per
projection: 37 LoRA GEMMs a layer instead of 49, x read once where it was read three times — an 8B step on an
H200 ran 4.7 % / 4.9 % faster (results/h200-2026-11-26/fp8-lora-grouped/). Each product is added into its
[M, N] output by `lora_add_` (a Triton kernel for large outputs, addmm_ otherwise). What is saved for backward is
what Unsloth saves (x; for the MLP x, e, g): the token budget's memory per token does not change.

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


def _lora_add(outs: Sequence[Tensor], x2: Tensor, As: Sequence[Tensor], Bs: Sequence[Tensor],
              scales: Sequence[float]) -> None:
    """outs[i] [M, N_i] += s_i (x A_i^T) B_i^T, in x's dtype. The group's x A_i^T are one GEMM: x is read
    once, not once per projection (q, k, v; gate, up)."""
    dt = x2.dtype
    a_cat, ranks = _cat(As, dt)
    xa = x2 @ a_cat.t()  # [M, sum r_i]
    for out, xa_i, b, s in zip(outs, xa.split(ranks, dim=1), Bs, scales, strict=True):
        lora_add_(out, xa_i, b, s)


def _lora_grads(dys: Sequence[Tensor], x2: Tensor, As: Sequence[Tensor], Bs: Sequence[Tensor],
                scales: Sequence[float], dx: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """(dA_i, dB_i) for out_i = x W_i^T + s_i (x A_i^T) B_i^T, and dx += sum_i s_i (dy_i B_i) A_i. Over the
    group, dA, dx's LoRA share and the recomputed x A^T are one GEMM each (x read twice, not twice per
    projection); dB_i stays one per projection (its dy_i is its own)."""
    dt = dys[0].dtype
    a_cat, ranks = _cat(As, dt)
    parts = [(dy @ b.to(dt)).mul_(s) for dy, b, s in zip(dys, Bs, scales, strict=True)]  # s_i dy_i B_i [M, r_i]
    y_b = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    da = list((y_b.t() @ x2).split(ranks))  # s_i (dy_i B_i)^T x
    lora_add_(dx, y_b, a_cat, 1.0, b_rows_are_rank=True)
    xa = x2 @ a_cat.t()
    db = [(dy.t() @ xa_i).mul_(s) for dy, xa_i, s in zip(dys, xa.split(ranks, dim=1), scales, strict=True)]
    return da, db


def _cat(As: Sequence[Tensor], dt: torch.dtype) -> tuple[Tensor, list[int]]:
    """[A_1; A_2; ...] [sum r_i, K] in dt, and the ranks."""
    parts = [a.to(dt) for a in As]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), [a.shape[0] for a in As]


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
        _lora_add(outs, x2, (qa, ka, va), (qb, kb, vb), (qs, ks, vs))
        outs = [o.view(*x.shape[:-1], base.out_features) for o, base in zip(outs, group.bases, strict=True)]
        ctx.save_for_backward(x, qa, qb, ka, kb, va, vb)
        ctx.group, ctx.scales = group, (qs, ks, vs)
        STATS.bump(STATS.fp8_calls, "qkv")
        return outs[0], outs[1], outs[2]

    @staticmethod
    @_bwd
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Any, ...]:
        x, qa, qb, ka, kb, va, vb = ctx.saved_tensors
        x2 = _flat(x)
        dys = [(_flat(d) if d is not None else x2.new_zeros(x2.shape[0], base.out_features))
               for d, base in zip((dq, dk, dv), ctx.group.bases, strict=True)]
        dx = fp8_dgrad(dys, ctx.group, x.dtype)
        das, dbs = _lora_grads(dys, x2, (qa, ka, va), (qb, kb, vb), ctx.scales, dx)
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
        _lora_add((y,), x2, (a,), (b,), (s,))
        ctx.save_for_backward(x, a, b)
        ctx.group, ctx.s = group, s
        STATS.bump(STATS.fp8_calls, "o")
        return y.view(*x.shape[:-1], base.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, a, b = ctx.saved_tensors
        x2, dy2 = _flat(x), _flat(dy)
        dx = fp8_dgrad((dy2,), ctx.group, x.dtype)
        (da,), (db,) = _lora_grads((dy2,), x2, (a,), (b,), (ctx.s,), dx)
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
        xq, sx = quant_x(x2)
        up, gate = gate_up.bases
        e = fp8_forward(xq, sx, gate, x.dtype)
        g = fp8_forward(xq, sx, up, x.dtype)
        _lora_add((e, g), x2, (ga, ua), (gb, ub), (gs, us))
        h = _flat(fwd(e.view(1, -1, e.shape[-1]), g.view(1, -1, g.shape[-1])))
        hq, sh = quant_x(h)
        (dbase,) = down.bases
        out = fp8_forward(hq, sh, dbase, x.dtype)
        _lora_add((out,), h, (da,), (db,), (ds,))
        ctx.save_for_backward(x, e, g, ga, gb, ua, ub, da, db)
        ctx.groups, ctx.scales, ctx.bwd = (gate_up, down), (gs, us, ds), bwd
        STATS.bump(STATS.fp8_calls, "mlp")
        return out.view(*x.shape[:-1], dbase.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, e, g, ga, gb, ua, ub, da, db = ctx.saved_tensors
        gate_up, down = ctx.groups
        gs, us, ds = ctx.scales
        x2, dy2 = _flat(x), _flat(dy).contiguous()
        dt = x.dtype
        dh = fp8_dgrad((dy2,), down, dt)  # dy Wd
        # down's LoRA by hand, not _lora_grads: dx's share goes into dh before the SwiGLU backward, its dA and dB
        # need h, which that backward writes into dh afterwards
        da_, db_ = da.to(dt), db.to(dt)
        y_bd = dy2 @ db_
        lora_add_(dh, y_bd, da_, ds, b_rows_are_rank=True)
        h, df, de = ctx.bwd(dh, e, g)  # in place: dh <- h, e <- df (grad of up), g <- de (grad of gate)
        d_da = (y_bd.t() @ h).mul_(ds)
        d_db = (dy2.t() @ (h @ da_.t())).mul_(ds)
        dx = fp8_dgrad((df, de), gate_up, dt)
        (d_ga, d_ua), (d_gb, d_ub) = _lora_grads((de, df), x2, (ga, ua), (gb, ub), (gs, us), dx)
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
