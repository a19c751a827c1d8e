"""Self-test of the FP8 LoRA Functions against a dense fp32 reference (issue 16).

Used three ways:
- at load, on CUDA, once per distinct (kind, shapes) of the model's units with 64 tokens: a unit whose
  Function fails or is wrong stays bf16 (so nothing can break mid-training for a shape reason);
- by the CPU tests, where the scaled matmuls are emulated (the logic: quantise rows, fold s_w into dy,
  group order, LoRA gradients);
- as the lead's pre-flight on the GPU: `python -m jobs.training.fp8.selftest [--out DIR]` runs every
  Function on the Llama-3.1-8B and Qwen3-32B shapes (CUDA against emulation against fp32), times
  bf16 against FP8 per projection, and prints a table (a few seconds plus the first compile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from jobs.training.config import FP8Storage
from jobs.training.fp8.compute import MAX_LAYER_ERROR
from jobs.training.fp8.lora import FP8LoraMLP, FP8LoraQKV, FP8LoraW, swiglu_backward_ref, swiglu_forward_ref
from jobs.training.fp8.matmul import FP8Base, FP8Group, FP8Linear, emulated, rel_error
from jobs.training.fp8.nf4 import NF4Source, bnb_nf4
from jobs.training.fp8.unsloth_layers import is_lora_layer

LORA_TOL = 0.02  # LoRA gradients that do not pass through an FP8 GEMM (q/k/v, o) must match closely


Lora = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]


def _dense(kind: str, x: torch.Tensor, ws: list[torch.Tensor], loras: list[Lora], s: float) -> Any:
    def lin(t: torch.Tensor, w: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        return t @ w.t() if a is None or b is None else t @ w.t() + s * (t @ a.t()) @ b.t()

    if kind == "qkv":
        return tuple(lin(x, w, a, b) for w, (a, b) in zip(ws, loras, strict=True))
    if kind in ("o", "linear"):
        return lin(x, ws[0], *loras[0])
    e, g = lin(x, ws[0], *loras[0]), lin(x, ws[1], *loras[1])
    return lin(torch.nn.functional.silu(e) * g, ws[2], *loras[2])


def check_kind(kind: str, shapes: list[tuple[int, int]], *, tokens: int = 64, device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16, rank: int | Sequence[int] = 16, seed: int = 0,
               swiglu: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
               lora_dtype: torch.dtype | None = None, with_lora: Sequence[bool] | None = None,
               nf4: Callable[[torch.Tensor], tuple[NF4Source, torch.Tensor]] | None = None) -> dict[str, float]:
    """Relative errors of one Function (outputs, dx, LoRA grads) against fp32 autograd on the same weights.
    `shapes`: (out, in) per projection: qkv (q, k, v), o/linear (one), mlp (gate, up, down); `rank`: one
    for all, or one per projection (PEFT's rank_pattern: a group's LoRA products are one GEMM over them);
    `lora_dtype`: the LoRA weights' (PEFT keeps them fp32), else `dtype`; `with_lora`: which projections have LoRA
    (all unless told: an adapter on q and v leaves k and the MLP without); `nf4`: the bases kept in NF4, made by this
    quantiser (weight -> (its NF4 source, the weight it dequantises to), which the reference then uses)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device)

    k_in = shapes[0][1]
    ws = [rnd(n, k, std=0.02) for n, k in shapes]
    srcs = [nf4(w) for w in ws] if nf4 is not None else None
    if srcs is not None:
        ws = [dense.float() for _, dense in srcs]
    ranks = [rank] * len(shapes) if isinstance(rank, int) else list(rank)
    wrapped = list(with_lora) if with_lora is not None else [True] * len(shapes)
    loras: list[Lora] = [(rnd(r, k, std=0.05), rnd(n, r, std=0.05)) if on else (None, None)
                         for (n, k), r, on in zip(shapes, ranks, wrapped, strict=True)]
    s = 2.0
    x = rnd(1, tokens, k_in)
    ref_in = x.clone().requires_grad_(True)
    ref_params = [_leaves(ab, None) for ab in loras]
    ref = _dense(kind, ref_in, ws, ref_params, s)
    outs = ref if isinstance(ref, tuple) else (ref,)
    dys = [rnd(*o.shape) for o in outs]
    torch.autograd.backward(outs, dys)

    bases = ([FP8Base.from_weight(w.to(dtype)) for w in ws] if srcs is None else
             [FP8Base.from_nf4(src, dense) for src, dense in srcs])
    xin = x.to(dtype).requires_grad_(True)
    ld = lora_dtype or dtype
    params = [_leaves(ab, ld) for ab in loras]
    flat = [t for a, b in params for t in (a, b, s if a is not None else 0.0)]
    if kind == "qkv":
        got = FP8LoraQKV.apply(xin, FP8Group(bases, keep_transposed=False), *flat)
    elif kind == "o":
        got = FP8LoraW.apply(xin, FP8Group(bases, keep_transposed=True), *flat)
    elif kind == "linear":
        got = FP8Linear.apply(xin, bases[0]) + s * (xin @ params[0][0].to(dtype).t()) @ params[0][1].to(dtype).t()
    else:
        fwd, bwd = swiglu or (swiglu_forward_ref, swiglu_backward_ref)
        gate_up = FP8Group([bases[1], bases[0]], keep_transposed=False)
        got = FP8LoraMLP.apply(xin, gate_up, FP8Group([bases[2]], keep_transposed=True), *flat, fwd, bwd)
    gots = got if isinstance(got, tuple) else (got,)
    torch.autograd.backward(gots, [d.to(dtype) for d in dys])
    err = {f"out{i}": rel_error(a, b) for i, (a, b) in enumerate(zip(gots, outs, strict=True))}
    err["dx"] = rel_error(xin.grad, ref_in.grad)
    for i, ((a, b), (ra, rb)) in enumerate(zip(params, ref_params, strict=True)):
        if a is not None and b is not None and ra is not None and rb is not None:
            err[f"dA{i}"], err[f"dB{i}"] = rel_error(a.grad, ra.grad), rel_error(b.grad, rb.grad)
    return err


def _leaves(ab: Lora, dtype: torch.dtype | None) -> Lora:
    """LoRA weights as fresh leaves (cast to `dtype`, else cloned); (None, None) stays."""
    a, b = ab
    if a is None or b is None:
        return None, None
    return (a.to(dtype) if dtype else a.clone()).requires_grad_(True), (b.to(dtype) if dtype else b.clone()
                                                                          ).requires_grad_(True)


def verdict(kind: str, err: dict[str, float]) -> str | None:
    """None when the errors are what FP8 gives, else what is wrong."""
    bad = [f"{k} {v:.3g}" for k, v in err.items() if not v <= MAX_LAYER_ERROR]
    if kind != "mlp":  # LoRA gradients of q/k/v/o see no FP8 GEMM: they must match closely
        bad += [f"{k} {v:.3g}" for k, v in err.items() if k[:2] in ("dA", "dB") and not v <= LORA_TOL]
    return None if not bad else "errors over the limit: " + ", ".join(bad)


def signature(unit: Any) -> tuple[str, str, tuple[tuple[int, int], ...], tuple[bool, ...]] | None:
    """(kind, route, shapes, which projections have LoRA) of a conversion unit; None when a base has no dense
    shape."""
    shapes = []
    for _name, proj in unit.projs.values():
        b = proj.base_layer
        n, k = getattr(b, "out_features", None), getattr(b, "in_features", None)
        if n is None or k is None:
            return None
        shapes.append((int(n), int(k)))
    kind = unit.kind if unit.route == "fused" else "linear"
    return kind, unit.route, tuple(shapes), tuple(is_lora_layer(proj) for _name, proj in unit.projs.values())


def unit_lora_dtype(unit: Any) -> torch.dtype | None:
    """The dtype of a unit's LoRA weights (PEFT: fp32), None if it has none."""
    for _name, proj in unit.projs.values():
        for a in getattr(proj, "lora_A", {}).values():
            return a.weight.dtype
    return None


def test_units(units: list[Any], *, device: str = "cuda", swiglu: Any = None,
               storage: FP8Storage = "fp8") -> dict[tuple[Any, ...], str | None]:
    """Run check_kind once per distinct signature (with the unit's LoRA dtype; with `storage = "nf4"` on bases kept
    in NF4 by bitsandbytes, as the conversion will keep a 4-bit model's); signature -> None (fine) or why not."""
    nf4 = bnb_nf4 if storage == "nf4" else None
    out: dict[tuple[Any, ...], str | None] = {}
    for u in units:
        sig = signature(u)
        if sig is None or sig in out or u.route == "blocked":
            continue
        kind, _route, shapes, with_lora = sig
        try:
            if kind == "linear":
                errs = [verdict("linear", check_kind("linear", [sh], device=device, nf4=nf4)) for sh in shapes]
                out[sig] = next((e for e in errs if e), None)
            else:
                out[sig] = verdict(kind, check_kind(kind, list(shapes), device=device, lora_dtype=unit_lora_dtype(u),
                                                    with_lora=with_lora,
                                                    swiglu=swiglu if kind == "mlp" else None, nf4=nf4))
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            out[sig] = f"self-test raised {type(e).__name__}: {e}"[:300]
    return out


# ---- the lead's pre-flight ------------------------------------------------------------------------

SHAPES = {
    "llama3.1-8b": {"qkv": [(4096, 4096), (1024, 4096), (1024, 4096)], "o": [(4096, 4096)],
                    "mlp": [(14336, 4096), (14336, 4096), (4096, 14336)]},
    "qwen3-32b": {"qkv": [(8192, 5120), (1024, 5120), (1024, 5120)], "o": [(5120, 8192)],
                  "mlp": [(25600, 5120), (25600, 5120), (5120, 25600)]},
}


def _time(fn: Callable[[], Any], iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def timing(n: int, k: int, m: int = 8192) -> dict[str, float]:
    """ms per forward + input gradient of one frozen projection: bf16 matmuls vs FP8 (quantisation and,
    without a kept copy, the per-backward transpose included)."""
    from jobs.training.fp8.matmul import fp8_dgrad, fp8_forward, quant_x

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    base = FP8Base.from_weight(w)
    one, kept = FP8Group([base], keep_transposed=False), FP8Group([base], keep_transposed=True)
    bf16 = _time(lambda: (x @ w.t(), dy @ w))
    fp8 = _time(lambda: (fp8_forward(*quant_x(x), base, torch.bfloat16), fp8_dgrad((dy,), one, torch.bfloat16)))
    fp8k = _time(lambda: (fp8_forward(*quant_x(x), base, torch.bfloat16), fp8_dgrad((dy,), kept, torch.bfloat16)))
    return {"bf16_ms": round(bf16, 3), "fp8_ms": round(fp8, 3), "fp8_kept_t_ms": round(fp8k, 3),
            "speedup": round(bf16 / fp8, 2), "speedup_kept_t": round(bf16 / fp8k, 2),
            "bf16_tflops": round(4 * m * n * k / bf16 / 1e9, 0), "fp8_tflops": round(4 * m * n * k / fp8 / 1e9, 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.training.fp8.selftest")
    ap.add_argument("--out", type=Path, help="write fp8-selftest.json here")
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args(argv)
    from jobs.training.fp8.compute import assess_card, card_info

    card = card_info()
    ok, why = assess_card(card)
    doc: dict[str, Any] = {"card": why, "fp8_possible": ok, "checks": [], "timing": {}}
    print(f"card: {why}", flush=True)
    if not ok:
        print(json.dumps(doc))
        return 1
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    failures = 0
    t0 = time.time()
    for arch, kinds in SHAPES.items():
        for kind, shapes in kinds.items():
            sw = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel) if kind == "mlp" else None
            err = check_kind(kind, shapes, tokens=a.tokens, swiglu=sw)
            with emulated():
                emu = check_kind(kind, shapes, tokens=256, swiglu=sw)
            bad = verdict(kind, err) or verdict(kind, emu)
            failures += bad is not None
            row = {"arch": arch, "kind": kind, "cuda": {k: round(v, 4) for k, v in err.items()},
                   "emulated": {k: round(v, 4) for k, v in emu.items()}, "problem": bad}
            doc["checks"].append(row)
            print(f"{arch:12} {kind:4} out {err['out0']:.4f} dx {err['dx']:.4f} "
                  f"max LoRA grad {max(v for k, v in err.items() if k[:2] in ('dA', 'dB')):.4f} "
                  f"(emulated dx {emu['dx']:.4f}) {'OK' if bad is None else 'FAIL: ' + bad}", flush=True)
    doc["check_seconds"] = round(time.time() - t0, 1)
    for name, (n, k) in {"8b q/o 4096x4096": (4096, 4096), "8b gate/up 14336x4096": (14336, 4096),
                         "8b down 4096x14336": (4096, 14336), "32b gate/up 25600x5120": (25600, 5120)}.items():
        doc["timing"][name] = t = timing(n, k)
        print(f"{name:24} bf16 {t['bf16_ms']:.3f} ms  fp8 {t['fp8_ms']:.3f} ms (x{t['speedup']})  "
              f"kept transposed {t['fp8_kept_t_ms']:.3f} ms (x{t['speedup_kept_t']})", flush=True)
    from jobs.training.fp8.matmul import STATS

    doc["stats"] = STATS.as_dict()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "fp8-selftest.json").write_text(json.dumps(doc, indent=1))
    print("fp8 self-test:", "PASSED" if not failures else f"{failures} FAILED", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
