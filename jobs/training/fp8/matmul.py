"""FP8 (e4m3) matmuls for frozen base projections: quantisation, the scaled matmul, the weight module
and the autograd Function (issue 16).

y = x W^T with W frozen, [N, K]:
- W is quantised once, at load, per output channel: Wq [N, K] e4m3 and s_w [N] fp32 dequant scales
  (W ~ diag(s_w) Wq). That is the layout of transformers' FbgemmFp8Linear (weight [N, K] fp8,
  weight_scale [N, 1] fp32), which Unsloth's own FP8 path reads too.
- forward: x is quantised per token (row), xq [M, K] and s_x [M, 1]; y = scaled_mm(xq, Wq^T, s_x, s_w).
  Wq^T is a free view: Wq stored [N, K] row-major is [K, N] column-major, the K-major layout that
  Hopper's FP8 GEMM requires of both operands.
- input gradient: dx = dy W = (dy * s_w) Wq. s_w is folded into dy before dy is quantised per row, so
  the gradient is exactly that of the quantised forward and W is never quantised twice. The GEMM
  contracts over N, so it needs Wq with N contiguous: the transposed copy Wq^T [K, N], kept
  (+1 byte per parameter) or built in each backward by a compiled transpose (~2 % of a step).
- no weight gradient (frozen) and nothing saved for the backward: dx does not need x.

Projections that share their input (q, k, v; gate, up) share one quantisation of x, and their input
gradients are ONE GEMM over the concatenated contraction, dx = [dy_q s_q | dy_k s_k | ...] [Wq; Wk; ...]
(an FP8Group).

`torch._scaled_mm` is CUDA-only. Off CUDA (and in tests) the same code runs an emulated scaled matmul
(dequantise both fp8 operands, fp32 matmul) that enforces the CUDA kernel's operand rules (row-major
mat1, column-major mat2, dims divisible by 16, fp32 scales shaped (M, 1) and (1, N)), so a layout or
scale mistake fails on the CPU as it would on the GPU. The quantisation is one Triton kernel on CUDA
(jobs/training/fp8/quant_kernel.py; eager it costs ~10x), and so is adding a LoRA product into a large
output (jobs/training/fp8/lora_add_kernel.py); each runs eagerly if its kernel fails (counted).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from jobs.training.fp8.e4m3 import ALIGN, E4M3, FMAX
from jobs.training.fp8.nf4 import NF4Source, nf4_to_fp8_ref, row_scales

log = structlog.get_logger("nightshift.train")



@dataclass
class Fp8Stats:
    """This process's counters: reported in the load info and the benchmark's rows."""

    fp8_calls: dict[str, int] = field(default_factory=dict)  # kind -> forward calls on FP8
    native_calls: dict[str, int] = field(default_factory=dict)  # "kind: reason" -> calls handed back to Unsloth
    compile_fallbacks: dict[str, str] = field(default_factory=dict)  # kernel -> error (ran eagerly instead)

    @staticmethod
    def bump(counter: dict[str, int], key: str) -> None:
        counter[key] = counter.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"fp8_calls": dict(self.fp8_calls), "native_calls": dict(self.native_calls),
                "compile_fallbacks": dict(self.compile_fallbacks)}


STATS = Fp8Stats()
_EMULATE = threading.local()


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Run the emulated scaled matmul and eager quantisation even on CUDA (the self-check compares)."""
    prev = getattr(_EMULATE, "on", False)
    _EMULATE.on = True
    try:
        yield
    finally:
        _EMULATE.on = prev


def _emulating(t: torch.Tensor) -> bool:
    return not t.is_cuda or getattr(_EMULATE, "on", False)


# ---- quantisation ---------------------------------------------------------------------------------


def quant_rows_ref(t: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (e4m3 [R, C], fp32 dequant scale [R, 1]); `col_scale` [1, C] multiplies t first."""
    x = t.float() if col_scale is None else t.float() * col_scale
    s = row_scales(x)
    return (x / s).clamp(-FMAX, FMAX).to(E4M3), s


def _transpose_cat(*ws: torch.Tensor) -> torch.Tensor:
    """[N_i, K] e4m3 weights -> [K, sum N_i] row-major (bytes moved as uint8: no fp8 arithmetic)."""
    u = [w.view(torch.uint8) for w in ws]
    cat = u[0] if len(u) == 1 else torch.cat(u, dim=0)
    return cat.t().contiguous().view(E4M3)


def _first_tensor(args: Sequence[Any]) -> torch.Tensor:
    """The first argument that is a tensor, or the first item of a sequence of them: where the call runs."""
    for a in args:
        t = a[0] if isinstance(a, (list, tuple)) else a
        if isinstance(t, torch.Tensor):
            return t
    raise TypeError("no tensor among the arguments")


class _FastPath:
    """`eager`'s result by a faster function on CUDA, made on first use by `load` (a Triton kernel from its
    module, imported then: Triton may be absent elsewhere; or `eager` torch.compiled, dynamic shapes: the
    tokens per step vary); `eager` itself off CUDA, under emulation, with NIGHTSHIFT_FP8_EAGER=1, or once
    the fast one has failed to load or compile (then counted in STATS)."""

    def __init__(self, name: str, eager: Callable[..., Any], load: Callable[[], Callable[..., Any]]) -> None:
        self.name, self.eager, self.load = name, eager, load
        self.fast: Callable[..., Any] | None = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _emulating(_first_tensor(args)) or self.failed is not None or os.environ.get("NIGHTSHIFT_FP8_EAGER") == "1":
            return self.eager(*args, **kwargs)
        try:
            if self.fast is None:
                with self._lock:
                    if self.fast is None:
                        self.fast = self.load()
            return self.fast(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # no Triton, or a compile failed (before any launch): eager computes the same
            self.failed = f"{type(e).__name__}: {e}"[:400]
            STATS.compile_fallbacks[self.name] = self.failed
            log.warning("fp8_kernel_not_compiled", kernel=self.name, error=self.failed)
            return self.eager(*args, **kwargs)


def _triton(module: str, name: str) -> Callable[[], Callable[..., Any]]:
    return lambda: getattr(importlib.import_module(module), name)


_TRANSPOSE = _FastPath("transpose_cat", _transpose_cat, lambda: torch.compile(_transpose_cat, dynamic=True))


def _quant_eager(ts: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    if scales is None:
        return quant_rows_ref(ts[0] if len(ts) == 1 else torch.cat(list(ts), dim=1))
    return quant_rows_ref(torch.cat([t.float() * s for t, s in zip(ts, scales, strict=True)], dim=1))


def lora_add_ref(out: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, alpha: float, *,
                 b_rows_are_rank: bool = False) -> torch.Tensor:
    """out += alpha * xa @ B^T with B = b [N, r], or alpha * xa @ b with `b_rows_are_rank` (b [r, N]), by
    addmm_ (cuBLAS on CUDA)."""
    return out.addmm_(xa, (b if b_rows_are_rank else b.t()).to(xa.dtype), alpha=alpha)


_QUANT = _FastPath("quant_rows", _quant_eager, _triton("jobs.training.fp8.quant_kernel", "quant_rows"))
# an NF4-stored base to e4m3 at each use (jobs/training/fp8/nf4.py)
_NF4 = _FastPath("nf4_to_fp8", nf4_to_fp8_ref, _triton("jobs.training.fp8.nf4_kernel", "nf4_to_fp8"))
# the LoRA products added into base outputs and input gradients (jobs/training/fp8/lora_add_kernel.py)
lora_add_ = _FastPath("lora_add_", lora_add_ref, _triton("jobs.training.fp8.lora_add_kernel", "lora_add_"))


def quant_x(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantisation of an activation [M, K]: (e4m3 [M, K], fp32 [M, 1])."""
    return _QUANT((x2d,), None)


def quant_scaled(ts: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """cat(t_i * s_i, dim=1) quantised per row: the dgrad operand with the weight scales folded in."""
    return _QUANT(ts, scales)


def transpose_cat(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    return _TRANSPOSE(*ws)


# ---- the scaled matmul ----------------------------------------------------------------------------


def check_operands(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> None:
    """The row-wise `_scaled_mm` rules on sm90 (torch 2.11): the emulation refuses what the CUDA kernel
    refuses."""
    m, k = a.shape
    k2, n = b.shape
    bad = []
    if a.dtype != E4M3 or b.dtype != E4M3:
        bad.append(f"operands must be float8_e4m3fn (got {a.dtype}, {b.dtype})")
    if k != k2:
        bad.append(f"inner dims differ ({k} vs {k2})")
    if k % ALIGN or n % ALIGN:
        bad.append(f"K={k} and N={n} must be divisible by {ALIGN}")
    if not a.is_contiguous():
        bad.append("mat1 must be row-major")
    if not b.t().is_contiguous():
        bad.append("mat2 must be column-major (K-major)")
    if sa.dtype != torch.float32 or tuple(sa.shape) != (m, 1) or not sa.is_contiguous():
        bad.append(f"scale_a must be contiguous fp32 ({m}, 1), got {sa.dtype} {tuple(sa.shape)}")
    if sb.dtype != torch.float32 or tuple(sb.shape) != (1, n) or not sb.is_contiguous():
        bad.append(f"scale_b must be contiguous fp32 (1, {n}), got {sb.dtype} {tuple(sb.shape)}")
    if bad:
        raise ValueError("scaled_mm: " + "; ".join(bad))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, *, out_dtype: torch.dtype,
              fast_accum: bool) -> torch.Tensor:
    """(a * sa) @ (b * sb) in out_dtype: torch._scaled_mm on CUDA (which refuses bad operands itself; the
    Python check cost ~40 us of host time a call on the H100 machine, ~14 ms an 8B step by arithmetic),
    emulated and checked elsewhere."""
    if _emulating(a):
        check_operands(a, b, sa, sb)
        return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


_ONES: dict[tuple[int, str], torch.Tensor] = {}
_FAST_ACCUM = os.environ.get("NIGHTSHIFT_FP8_FAST_ACCUM", "1") != "0"


def ones_row(k: int, device: torch.device) -> torch.Tensor:
    key = (k, str(device))
    if key not in _ONES:
        _ONES[key] = torch.ones(1, k, dtype=torch.float32, device=device)
    return _ONES[key]


# ---- the frozen weight ----------------------------------------------------------------------------


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen weight [N, K] -> (e4m3 [N, K], fp32 [N, 1]): one scale per output channel."""
    return quant_rows_ref(w)


def shape_supported(out_features: int, in_features: int) -> bool:
    return out_features % ALIGN == 0 and in_features % ALIGN == 0


class FP8Base(torch.nn.Module):
    """A frozen Linear with an e4m3 weight [N, K] and fp32 per-output-channel scales [N, 1]
    (transformers' FbgemmFp8Linear layout). Its forward is FP8Linear: FP8 forward and input gradient.

    Storage: the e4m3 weight itself (`weight`), or the NF4 bytes it came from (`nf4`, `weight` None), dequantised
    straight to the same e4m3 values at each use (jobs/training/fp8/nf4.py)."""

    def __init__(self, weight: torch.Tensor | None, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 nf4: NF4Source | None = None) -> None:
        super().__init__()
        if (weight is None) == (nf4 is None):
            raise ValueError("an FP8Base holds either its e4m3 weight or its NF4 source")
        n, k = nf4.shape if nf4 is not None else weight.shape  # type: ignore[union-attr]
        self.out_features, self.in_features = int(n), int(k)
        self.weight = None if weight is None else torch.nn.Parameter(weight, requires_grad=False)
        self.nf4 = nf4
        self.weight_scale = torch.nn.Parameter(scale.reshape(-1, 1).float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._single: FP8Group | None = None  # this projection alone (its own forward's backward)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> FP8Base:
        q, s = quantize_weight(w)
        return cls(q, s, bias)

    @classmethod
    def from_nf4(cls, src: NF4Source, w: torch.Tensor, bias: torch.Tensor | None = None) -> FP8Base:
        """Kept in NF4; `w` is its dequantised weight (bf16 [N, K]), read once for the scales."""
        return cls(None, row_scales(w), bias, nf4=src)

    def fp8_weight(self) -> torch.Tensor:
        """The e4m3 weight [N, K]: held, or dequantised from NF4 now."""
        if self.weight is not None:
            return self.weight
        out = torch.empty(self.out_features, self.in_features, dtype=E4M3, device=self.weight_scale.device)
        return _NF4(self.nf4, self.weight_scale, out)

    def write_transposed(self, out: torch.Tensor) -> None:
        """W^T into `out` [K, N] (a column slice of a group's [K, sum N])."""
        if self.weight is not None:
            out.view(torch.uint8).copy_(self.weight.view(torch.uint8).t())
        else:
            _NF4(self.nf4, self.weight_scale, out.t())

    def scale_row(self) -> torch.Tensor:
        return self.weight_scale.view(1, -1)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.fp8_weight().float() * self.weight_scale).to(dtype)

    def own_group(self, keep_transposed: bool = False) -> FP8Group:
        if self._single is None or (keep_transposed and self._single.weight_t is None):
            self._single = FP8Group((self,), keep_transposed=keep_transposed)
        return self._single

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = FP8Linear.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 row-wise "
                f"({'e4m3' if self.nf4 is None else 'NF4, to e4m3 at each use'})")


class FP8Group:
    """Frozen projections sharing an input: their input gradients are one GEMM over the concatenated
    contraction, against [W_1; W_2; ...]^T [K, sum N] (kept, or built per backward)."""

    def __init__(self, bases: Sequence[FP8Base], *, keep_transposed: bool) -> None:
        ks = {b.in_features for b in bases}
        if len(ks) != 1:
            raise ValueError(f"a group's projections must share in_features, got {sorted(ks)}")
        self.bases = tuple(bases)
        self.in_features = ks.pop()
        self.weight_t = self._build_transposed() if keep_transposed else None

    def _build_transposed(self) -> torch.Tensor:
        if all(b.weight is not None for b in self.bases):
            return transpose_cat([b.weight for b in self.bases])
        out = torch.empty(self.in_features, sum(b.out_features for b in self.bases), dtype=E4M3,
                          device=self.bases[0].weight_scale.device)
        col = 0
        for b in self.bases:  # NF4 bases dequantised straight into their columns
            b.write_transposed(out[:, col:col + b.out_features])
            col += b.out_features
        return out

    def transposed(self) -> torch.Tensor:
        return self.weight_t if self.weight_t is not None else self._build_transposed()

    @property
    def kept_bytes(self) -> int:
        return 0 if self.weight_t is None else self.weight_t.numel()


def fast_accum_forward() -> bool:
    """Forward GEMMs with Hopper's fast accumulation: 1375 vs 1200 TFLOP/s, same 3.75 % error at K=4096
    (measured on the H100/H200); NIGHTSHIFT_FP8_FAST_ACCUM=0 turns it off (the input gradient never uses it)."""
    return _FAST_ACCUM


def fp8_forward(xq: torch.Tensor, sx: torch.Tensor, base: FP8Base, out_dtype: torch.dtype) -> torch.Tensor:
    """x W^T from the quantised activation: [M, N] in out_dtype."""
    return scaled_mm(xq, base.fp8_weight().t(), sx, base.scale_row(), out_dtype=out_dtype, fast_accum=_FAST_ACCUM)


def fp8_dgrad(dys: Sequence[torch.Tensor], group: FP8Group, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_i dy_i W_i as one FP8 GEMM: dy_i [M, N_i] in the group's order -> dx [M, K]."""
    dq, sd = quant_scaled(dys, [b.scale_row() for b in group.bases])
    wt = group.transposed()
    return scaled_mm(dq, wt.t(), sd, ones_row(group.in_features, dq.device), out_dtype=out_dtype, fast_accum=False)


class FP8Linear(torch.autograd.Function):
    """y = x W^T for one frozen FP8Base: forward and input gradient in FP8, nothing saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, base: FP8Base) -> torch.Tensor:
        shape = x.shape
        xq, sx = quant_x(x.reshape(-1, shape[-1]))
        y = fp8_forward(xq, sx, base, x.dtype)
        ctx.base, ctx.in_shape, ctx.dtype = base, shape, x.dtype
        STATS.bump(STATS.fp8_calls, "linear")
        return y.view(*shape[:-1], base.out_features)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        dx = fp8_dgrad((dy.reshape(-1, dy.shape[-1]),), ctx.base.own_group(), ctx.dtype)
        return dx.view(ctx.in_shape), None


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in fp32 (Frobenius)."""
    ref = ref.detach().float()
    return float((y.detach().float() - ref).norm() / ref.norm().clamp(min=1e-30))


def probe_scaled_mm(device: str = "cuda") -> str | None:
    """A small FP8 forward and input gradient on this card against fp32: None, or what went wrong."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(48, 64, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(32, 64, device=device, generator=g, dtype=torch.bfloat16)
        dy = torch.randn(48, 32, device=device, generator=g, dtype=torch.bfloat16)
        base = FP8Base.from_weight(w)
        xq, sx = quant_rows_ref(x)
        y = fp8_forward(xq, sx, base, torch.bfloat16)
        dx = fp8_dgrad((dy,), base.own_group(), torch.bfloat16)
        torch.cuda.synchronize()
        errs = rel_error(y, x.float() @ w.float().t()), rel_error(dx, dy.float() @ w.float())
        if not all(e < 0.1 for e in errs):
            return f"wrong results: relative errors {errs[0]:.3f} (forward), {errs[1]:.3f} (input gradient)"
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]
