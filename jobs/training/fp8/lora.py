"""LoRA over FP8 frozen bases, fused the way Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP are (issue 16).

Each Function computes out = x W^T + S (x A^T) B^T per projection with the base term on FP8
(jobs/training/fp8/matmul.py: one quantisation of x per group, fast-accumulation forward) and the LoRA term in
the activations' dtype; backward: the base input gradient is one FP8 GEMM per group with the weight
scales folded into dy, the LoRA gradients (in the weights' dtype) and their share of dx from bf16 GEMMs.
A group's LoRA products that read the same x (q, k, v; gate, up) are one GEMM each (x A^T, dA, dx's
LoRA share) instead of one per projection — an 8B step on an H200 ran 4.7 % / 4.9 % faster
(RESULTS.md: 2026-11-26, LoRA grouped GEMM). Each product is added into its [M, N] output by `lora_add_`
(a Triton kernel for large outputs, addmm_ otherwise).

Saved for backward: what Unsloth saves (x; for the MLP x, e, g), and per group x A^T [M, sum r] and the LoRA
weights cast to the activations' dtype (PEFT keeps them fp32: its autocast_adapter_dtype). So the backward neither
recomputes x A^T nor casts a weight, and cuBLAS writes the fp32 gradients itself: an 8B step made 3,342 launch
calls instead of 4,910 (RESULTS.md: 2026-11-26, FP8 fewer launches). Memory: 7 KB a token more by arithmetic; the
bench's memory line read 3.632 / 3.643 MB a token against 3.627 / 3.639 before.

Plain LoRA only (one adapter, no dropout, no lora bias, no DoRA): the callers (jobs/training/fp8/unsloth_layers.py)
call the projections as modules otherwise. A projection may have no LoRA at all (None for its A and B): an
adapter on q and v leaves k and the whole MLP without one, and those layers run here too. Device-agnostic: on the
CPU the scaled matmuls are emulated, which is how tests check the gradients against a dense reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from jobs.training.fp8.lora_cast import CACHE as CAST
from jobs.training.fp8.matmul import STATS, FP8Group, fp8_dgrad, fp8_forward, lora_add_, quant_x

_fwd = torch.amp.custom_fwd(device_type="cuda")
_bwd = torch.amp.custom_bwd(device_type="cuda")
Tensor = torch.Tensor


def _weights(As: Sequence[Tensor], Bs: Sequence[Tensor], dt: torch.dtype) -> tuple[Tensor, list[int], list[Tensor]]:
    """([A_1; A_2; ...] [sum r_i, K], the ranks, each B_i) in the activations' dtype, made once in the forward and
    saved for the backward: PEFT keeps LoRA weights in fp32 (autocast_adapter_dtype), and casting them at each use
    (forward and backward) was ~25 launches a layer, counted from the code."""
    ranks = [a.shape[0] for a in As]
    cached = CAST.get(As, Bs, dt)  # cast after the last optimizer step (jobs/training/fp8/lora_cast.py)
    if cached is not None:
        return cached[0], ranks, cached[1]
    a_cat = (As[0] if len(As) == 1 else torch.cat(list(As))).to(dt)
    return a_cat, ranks, [b.to(dt) for b in Bs]


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


@dataclass(frozen=True)
class _Lora:
    """The LoRA terms of a group's projections, where some may have none: an adapter on q and v only leaves k
    (and the whole MLP) without one, and Unsloth then fuses nothing, so these Functions run such layers too.
    `idx`: the projections that have LoRA, in group order. The tensors travel through save_for_backward
    (`saved()` drops them from what ctx keeps, `with_tensors` puts them back)."""

    n: int
    idx: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    dtype: torch.dtype | None  # the LoRA weights' (their gradients')
    a_cat: Tensor | None = None
    bs: tuple[Tensor, ...] = ()

    @classmethod
    def of(cls, As: Sequence[Tensor | None], Bs: Sequence[Tensor | None], scales: Sequence[float],
           dt: torch.dtype) -> _Lora:
        idx = tuple(i for i, a in enumerate(As) if a is not None)
        if not idx:
            return cls(len(As), (), (), (), None)
        a_cat, ranks, bs = _weights([As[i] for i in idx], [Bs[i] for i in idx], dt)  # type: ignore[misc]
        return cls(len(As), idx, tuple(ranks), tuple(scales[i] for i in idx), As[idx[0]].dtype,  # type: ignore[union-attr]
                   a_cat, tuple(bs))

    def add(self, outs: Sequence[Tensor], x2: Tensor) -> Tensor | None:
        """outs[i] += s_i (x A_i^T) B_i^T where projection i has LoRA; x A^T over them (None: no LoRA)."""
        if not self.idx:
            return None
        return _lora_add([outs[i] for i in self.idx], x2, self.a_cat, self.ranks, self.bs, self.scales)

    def saved(self) -> _Lora:
        return replace(self, a_cat=None, bs=())

    def with_tensors(self, a_cat: Tensor | None, bs: Sequence[Tensor]) -> _Lora:
        return replace(self, a_cat=a_cat, bs=tuple(bs))

    def grads(self, dys: Sequence[Tensor], x2: Tensor, xa: Tensor | None, dx: Tensor) -> list[Tensor | None]:
        """(dA, dB, None) per projection of the group, Nones where it has no LoRA; dx += LoRA's share."""
        out: list[Tensor | None] = [None] * (3 * self.n)
        if self.idx:
            das, dbs = _lora_grads([dys[i] for i in self.idx], x2, xa, self.a_cat, self.ranks, self.bs, self.scales,
                                   dx, self.dtype)
            for i, da, db in zip(self.idx, das, dbs, strict=True):
                out[3 * i], out[3 * i + 1] = da, db
        return out


class FP8LoraQKV(torch.autograd.Function):
    """Q, K, V = x Wq^T + LoRA, x Wk^T + LoRA, x Wv^T + LoRA; the group holds (q, k, v); a projection without
    LoRA passes None for its A and B."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, group: FP8Group, qa: Tensor | None, qb: Tensor | None, qs: float,
                ka: Tensor | None, kb: Tensor | None, ks: float, va: Tensor | None, vb: Tensor | None, vs: float
                ) -> tuple[Tensor, Tensor, Tensor]:
        x2 = _flat(x)
        xq, sx = quant_x(x2)
        outs = [fp8_forward(xq, sx, base, x.dtype) for base in group.bases]
        lora = _Lora.of((qa, ka, va), (qb, kb, vb), (qs, ks, vs), x.dtype)
        xa = lora.add(outs, x2)
        outs = [o.view(*x.shape[:-1], base.out_features) for o, base in zip(outs, group.bases, strict=True)]
        ctx.save_for_backward(x, xa, lora.a_cat, *lora.bs)
        ctx.group, ctx.lora = group, lora.saved()
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
        return (dx.view(x.shape), None, *ctx.lora.with_tensors(a_cat, bs).grads(dys, x2, xa, dx))


class FP8LoraW(torch.autograd.Function):
    """One projection (o_proj): y = x W^T + s (x A^T) B^T; the group holds the one base."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, group: FP8Group, a: Tensor, b: Tensor, s: float) -> Tensor:
        x2 = _flat(x)
        xq, sx = quant_x(x2)
        (base,) = group.bases
        y = fp8_forward(xq, sx, base, x.dtype)
        lora = _Lora.of((a,), (b,), (s,), x.dtype)
        xa = lora.add((y,), x2)
        ctx.save_for_backward(x, xa, lora.a_cat, *lora.bs)
        ctx.group, ctx.lora = group, lora.saved()
        STATS.bump(STATS.fp8_calls, "o")
        return y.view(*x.shape[:-1], base.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, xa, a_cat, *bs = ctx.saved_tensors
        x2, dy2 = _flat(x), _flat(dy)
        dx = fp8_dgrad((dy2,), ctx.group, x.dtype)
        return (dx.view(x.shape), None, *ctx.lora.with_tensors(a_cat, bs).grads((dy2,), x2, xa, dx))


Swiglu = Callable[[Tensor, Tensor], Tensor]
SwigluBackward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


class FP8LoraMLP(torch.autograd.Function):
    """out = down(swiglu(gate(x), up(x))), each projection FP8 base + LoRA (None for its A and B: none).

    `gate_up` holds (up, gate) — the order of [df | de] in the input gradient's one GEMM —, `down` the
    down projection. `fwd(e, g)` -> h for e, g [b, s, I]; `bwd(dh, e, g)` -> (h, df, de), written into
    its arguments (Unsloth's swiglu kernels, or the reference versions below)."""

    @staticmethod
    @_fwd
    def forward(ctx: Any, x: Tensor, gate_up: FP8Group, down: FP8Group, ga: Tensor | None, gb: Tensor | None,
                gs: float, ua: Tensor | None, ub: Tensor | None, us: float, da: Tensor | None, db: Tensor | None,
                ds: float, fwd: Swiglu, bwd: SwigluBackward) -> Tensor:
        x2 = _flat(x)
        dt = x.dtype
        xq, sx = quant_x(x2)
        up, gate = gate_up.bases
        e = fp8_forward(xq, sx, gate, dt)
        g = fp8_forward(xq, sx, up, dt)
        gu = _Lora.of((ga, ua), (gb, ub), (gs, us), dt)
        xa = gu.add((e, g), x2)
        h = _flat(fwd(e.view(1, -1, e.shape[-1]), g.view(1, -1, g.shape[-1])))
        hq, sh = quant_x(h)
        (dbase,) = down.bases
        out = fp8_forward(hq, sh, dbase, dt)
        dn = _Lora.of((da,), (db,), (ds,), dt)
        ha = dn.add((out,), h)
        ctx.save_for_backward(x, e, g, xa, ha, gu.a_cat, dn.a_cat, *gu.bs, *dn.bs)
        ctx.groups, ctx.bwd, ctx.lora = (gate_up, down), bwd, (gu.saved(), dn.saved())
        STATS.bump(STATS.fp8_calls, "mlp")
        return out.view(*x.shape[:-1], dbase.out_features)

    @staticmethod
    @_bwd
    def backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
        x, e, g, xa, ha, gu_a, d_a, *bs = ctx.saved_tensors
        gu, dn = ctx.lora
        gu, dn = gu.with_tensors(gu_a, bs[:len(gu.idx)]), dn.with_tensors(d_a, bs[len(gu.idx):])
        gate_up, down = ctx.groups
        x2, dy2 = _flat(x), _flat(dy).contiguous()
        dt = x.dtype
        dh = fp8_dgrad((dy2,), down, dt)  # dy Wd
        # down's LoRA by hand, not _Lora.grads: dx's share goes into dh before the SwiGLU backward, its dA
        # needs h, which that backward writes into dh afterwards
        if dn.idx:
            (d_b,), (ds,) = dn.bs, dn.scales
            y_bd = dy2 @ d_b
            lora_add_(dh, y_bd, d_a, ds, b_rows_are_rank=True)
        h, df, de = ctx.bwd(dh, e, g)  # in place: dh <- h, e <- df (grad of up), g <- de (grad of gate)
        down_grads = ([grad_mm(y_bd.t(), h, ds, dn.dtype), grad_mm(dy2.t(), ha, ds, dn.dtype)] if dn.idx
                      else [None, None])
        dx = fp8_dgrad((df, de), gate_up, dt)
        return (dx.view(x.shape), None, None, *gu.grads((de, df), x2, xa, dx), *down_grads, None, None, None)


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
