"""Packed rows without attention across samples, for models with attention sinks (GPT-OSS).

Why: transformers 5.17 builds GPT-OSS's causal masks without `position_ids`, so a packed row (positions
restarting at 0 for every sample, no attention mask) gets one causal mask over the whole row and its
samples attend to each other; Unsloth blocks padding-free batching for GPT-OSS for the same reason (its
flex attention). This registers one attention implementation, "nightshift_packed", that reads the
samples' boundaries from `position_ids` (a sample starts where a position is 0, and at each row's start)
and attends within each sample only: causal, the layer's sliding window, the model's attention sinks.

- CUDA, bf16/fp16: one varlen flash-attention call per layer (torch's aten flash kernels, which take
  grouped K/V heads and windows), the sinks applied afterwards by renormalising with the kernel's
  log-sum-exp: out = O * sigmoid(lse - sink). The backward is the kernel's own, fed dout * r and the
  renormalised output (derivation in `_FlashSinks`). Nothing of size T x T exists.
- otherwise (CPU, or flash kernels that fail their first check): scaled_dot_product_attention per sample,
  the sink as one extra key whose value is zero and whose logit is the sink.

No mask is built for this implementation (it is not in transformers' mask registry). Right-padded batches
(evaluation) need none: under causal attention a real token never sees the padding after it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("nightshift.train")

NAME = "nightshift_packed"
_STATE: dict[str, Any] = {"flash": None, "flash_check": None}  # None: not checked yet on this process
_LAST: list[Any] = [None, None]  # (position_ids tensor, Segments): one computation per forward, not per layer


@dataclass(frozen=True)
class Segments:
    """The samples of a batch flattened to B*T tokens: cumulative starts (device, int32), maxima, and
    (row, start, query length, key length) of each for the per-sample path."""

    cu_q: Any
    cu_k: Any
    max_q: int
    max_k: int
    bounds: list[tuple[int, int, int, int]]


def segments(position_ids: Any, batch: int, q_len: int, k_len: int, device: Any) -> Segments:
    """Sample boundaries from reset positions (one host sync per forward: the lengths)."""
    import torch

    if _LAST[0] is not None and _LAST[0] is position_ids and _LAST[1][0] == (batch, q_len, k_len, str(device)):
        return _LAST[1][1]
    if position_ids is None or q_len != k_len:  # decoding with a cache, or no positions: one sample per row
        ar = torch.arange(batch + 1, device=device, dtype=torch.int32)
        seg = Segments(ar * q_len, ar * k_len, q_len, k_len, [(b, 0, q_len, k_len) for b in range(batch)])
    else:
        pos = position_ids.to(device)
        if pos.shape[0] != batch:
            pos = pos.expand(batch, q_len)
        start = pos.reshape(-1).eq(0)
        start[::q_len] = True
        cu = torch.cat([start.nonzero().flatten(), torch.tensor([batch * q_len], device=device)]).to(torch.int32)
        host = cu.tolist()
        lengths = [b - a for a, b in itertools.pairwise(host)]
        bounds = [(a // q_len, a % q_len, n, n) for a, n in zip(host, lengths, strict=False)]
        seg = Segments(cu, cu, max(lengths), max(lengths), bounds)
    _LAST[:] = [position_ids, ((batch, q_len, k_len, str(device)), seg)]
    return seg


# ---- the flash path ------------------------------------------------------------------------------


class AtenFlash:
    """torch's own varlen flash kernels (the calls Unsloth's lean varlen path makes on torch 2.11)."""

    @staticmethod
    def forward(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, scale: float, wl: int,
                wr: int) -> tuple[Any, Any, Any, Any]:
        import torch

        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, wl == -1 and wr == 0, False,
            scale=scale, window_size_left=wl, window_size_right=wr)
        return out, lse, seed, offset

    @staticmethod
    def backward(g: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int,
                 seed: Any, offset: Any, scale: float, wl: int, wr: int) -> tuple[Any, Any, Any]:
        import torch

        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, wl == -1 and wr == 0, seed, offset,
            scale=scale, window_size_left=wl, window_size_right=wr)
        return dq, dk, dv


def lse_rows(lse: Any, cu: Any, total: int) -> Any:
    """The kernel's log-sum-exp as (heads, total tokens): varlen kernels return it so (fp32); older ones
    as (sequences, heads, max length), which is gathered back per token."""
    import torch

    if lse.dim() == 2 and lse.shape[1] == total:
        return lse
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lse.device), lengths, output_size=total)
    pos = torch.arange(total, device=lse.device) - cu.long()[seq]
    return lse[seq, :, pos].t()


@functools.cache
def _flash_sinks() -> Any:
    import torch

    class _FlashSinks(torch.autograd.Function):
        """out = O * r, r = sigmoid(lse - sink) per (token, head): softmax over the keys and the sink.

        Backward: L depends on O through out and through lse. dL/dO = dout * r =: G, and
        dL/dlse = rowsum(dout . O) * r (1 - r). A flash backward computes dS = P . (dP - D) with
        D = rowsum(G . O_given); the lse path adds P * dL/dlse, i.e. D must become
        r * c - c * r (1 - r) = c r^2, c = rowsum(dout . O). Feeding the kernel G and O_given = out (= O r)
        gives exactly rowsum(G . out) = c r^2. The sink's own gradient is -rowsum(dout . out) * (1 - r).
        """

        @staticmethod
        def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, wl, wr, kernels):  # type: ignore[override]
            out, lse, seed, offset = kernels.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, wl, wr)
            r = None
            acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for bf16 (fp64 stays fp64)
            if sinks is not None:
                rows = lse_rows(lse, cu_q, q.shape[0]).to(acc)
                r = torch.sigmoid(rows - sinks.detach().to(acc)[:, None]).t().unsqueeze(-1)  # (total, heads, 1)
                out = (out.to(acc) * r).to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_q, cu_k, *([r] if r is not None else []))
            ctx.args = (max_q, max_k, scale, wl, wr)
            ctx.kernels = kernels
            ctx.sinks_dtype = None if sinks is None or not sinks.requires_grad else sinks.dtype
            return out

        @staticmethod
        def backward(ctx, dout):  # type: ignore[override]
            q, k, v, out, lse, seed, offset, cu_q, cu_k, *rest = ctx.saved_tensors
            max_q, max_k, scale, wl, wr = ctx.args
            g = dout if not rest else (dout.to(rest[0].dtype) * rest[0]).to(dout.dtype)
            dq, dk, dv = ctx.kernels.backward(g.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, seed,
                                              offset, scale, wl, wr)
            dsinks = None
            if rest and ctx.sinks_dtype is not None:
                c = (dout.to(rest[0].dtype) * out.to(rest[0].dtype)).sum(-1, keepdim=True)
                dsinks = (-(c * (1 - rest[0])).sum(dim=(0, 2))).to(ctx.sinks_dtype)
            return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None

    return _FlashSinks


def flash_attention(query: Any, key: Any, value: Any, seg: Segments, scale: float, window: int | None, sinks: Any,
                    kernels: Any = AtenFlash) -> Any:
    """(B, H, T, D) inputs -> (B, T, H, D) output through the varlen kernels."""
    b, h, tq, d = query.shape
    q = query.transpose(1, 2).reshape(b * tq, h, d)
    k = key.transpose(1, 2).reshape(b * key.shape[2], key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * value.shape[2], value.shape[1], d)
    wl = window - 1 if window else -1
    out = _flash_sinks().apply(q, k, v, sinks, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, scale, wl, 0, kernels)
    return out.view(b, tq, h, d)


# ---- the per-sample path -------------------------------------------------------------------------


def sdpa_attention(query: Any, key: Any, value: Any, seg: Segments, scale: float, window: int | None,
                   sinks: Any) -> Any:
    """(B, H, T, D) inputs -> (B, T, H, D): one scaled_dot_product_attention per sample."""
    import torch
    import torch.nn.functional as F

    b, h, _tq, d = query.shape
    rep = h // key.shape[1]
    rows: list[list[Any]] = [[] for _ in range(b)]
    for row, s, lq, lk in seg.bounds:
        sk = s if lq == lk else 0
        q = query[row : row + 1, :, s : s + lq]
        k = key[row : row + 1, :, sk : sk + lk].repeat_interleave(rep, dim=1)
        v = value[row : row + 1, :, sk : sk + lk].repeat_interleave(rep, dim=1)
        qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        ki = torch.arange(lk, device=q.device)[None, :]
        allowed = ki <= qi
        if window:
            allowed = allowed & (ki > qi - window)
        bias = torch.zeros(lq, lk, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        bias = bias.expand(1, h, lq, lk)
        if sinks is not None:
            k = torch.cat([k, k.new_zeros(1, h, 1, d)], dim=2)
            v = torch.cat([v, v.new_zeros(1, h, 1, d)], dim=2)
            bias = torch.cat([bias, sinks.to(q.dtype).view(1, h, 1, 1).expand(1, h, lq, 1)], dim=-1)
        rows[row].append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale))
    out = torch.cat([torch.cat(r, dim=2) for r in rows], dim=0)
    return out.transpose(1, 2)


# ---- the registered implementation ---------------------------------------------------------------


def packed_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                     dropout: float = 0.0, sliding_window: int | None = None, s_aux: Any = None,
                     position_ids: Any = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface: (B, H, T, D) query/key/value -> ((B, T, H, D) output, None)."""
    b, _h, tq, d = query.shape
    seg = segments(position_ids, b, tq, key.shape[2], query.device)
    scale = scaling if scaling is not None else d**-0.5
    if flash_usable(query):
        return flash_attention(query, key, value, seg, scale, sliding_window, s_aux), None
    return sdpa_attention(query, key, value, seg, scale, sliding_window, s_aux), None


def flash_usable(query: Any) -> bool:
    import torch

    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256):
        return False
    if _STATE["flash"] is None:
        check_flash(query.device, query.dtype)
    return bool(_STATE["flash"])


def check_flash(device: Any, dtype: Any) -> dict[str, Any]:
    """Run the self-check once and decide the path of this process: flash if it passed."""
    _STATE["flash_check"] = self_check(device, dtype)
    _STATE["flash"] = bool(_STATE["flash_check"]["ok"])
    if not _STATE["flash"]:
        log.warning("packed_attention_flash_unusable", **_STATE["flash_check"])
    return _STATE["flash_check"]


def self_check(device: Any, dtype: Any, *, tol: float = 0.05, kernels: Any = AtenFlash) -> dict[str, Any]:
    """The flash path against the per-sample path on small random packed rows (forward and backward, GQA,
    a window, frozen sinks as in training). `ok` False (and the error) when the kernels fail or disagree."""
    import torch

    try:
        with torch.enable_grad():  # the first use may come from an evaluation under no_grad
            return _compare(device, dtype, tol, kernels)
    except Exception as e:  # the kernels are missing or their signature differs: the per-sample path runs
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        _LAST[:] = [None, None]


def _compare(device: Any, dtype: Any, tol: float, kernels: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    lengths, h, kv, d = [5, 37, 90], 8, 2, 64
    t = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    mk = [torch.randn(1, n, t, d, device=device, generator=g, dtype=torch.float32) for n in (h, kv, kv)]
    sinks = torch.randn(h, device=device, generator=g)
    weight = torch.linspace(-1, 1, t * h * d, device=device).view(1, t, h, d)
    res: dict[str, Any] = {}
    for name in ("flash", "sdpa"):
        q, k, v = (x.to(dtype).requires_grad_() for x in mk)
        seg = segments(pos, 1, t, t, device)
        out = (flash_attention(q, k, v, seg, d**-0.5, 16, sinks, kernels) if name == "flash"
               else sdpa_attention(q, k, v, seg, d**-0.5, 16, sinks))
        (out.float() * weight).sum().backward()
        res[name] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    errs = [float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(res["flash"], res["sdpa"], strict=True)]
    return {"ok": max(errs) < tol,
            "max_rel_err": {n: round(e, 5) for n, e in zip(("out", "dq", "dk", "dv"), errs, strict=True)}}


def backend() -> str:
    if _STATE["flash"] is None:
        return "not used yet"
    return "flash varlen + sinks" if _STATE["flash"] else "sdpa per sample (flash unusable)"


def has_sinks(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) == "gpt_oss" or any(
        hasattr(m, "sinks") for m in model.modules())


def use_packed_attention(model: Any) -> str:
    """Register the implementation and point the model (a PEFT model's base too) at it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        base.set_attn_implementation(NAME)
    except Exception:  # older transformers: the config is what the layers read
        for cfg in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
            cfg._attn_implementation = NAME
    if base.config._attn_implementation != NAME:
        raise RuntimeError(f"could not switch {type(base).__name__} to the {NAME} attention "
                           f"(it reports {base.config._attn_implementation!r})")
    return NAME
