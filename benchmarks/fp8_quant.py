"""`python -m benchmarks fp8-quant`: the FP8 step's per-row quantisations timed on this GPU, side by side.

The quantisations one decoder layer of the architecture runs per step (forward: the inputs of q/k/v,
o, gate/up and down; backward: the input-gradient operands with the weight scales folded in), each
timed as our Triton kernel (jobs/training/fp8/quant_kernel.py) and as Inductor's compilation of the
reference (torch.compile(dynamic=True), the path the FP8 step used before), with the bytes each must
move, the effective bandwidth, and how the results compare with the reference (identical codes, or
codes that differ only where the exact quotient sits on a rounding midpoint).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# (call, input widths, column scales?) for a Llama-style layer: hidden H, intermediate I, query width Q
# (heads x head dim: H for Llama-3.1-8B and Qwen3-8B, 8,192 for Qwen3-32B), key/value width KV
Shape = tuple[str, tuple[int, ...], bool]


def layer_calls(hidden: int, intermediate: int, q: int, kv: int) -> list[Shape]:
    return [
        ("fwd x (q,k,v)", (hidden,), False), ("fwd x (o)", (q,), False),
        ("fwd x (gate,up)", (hidden,), False), ("fwd h (down)", (intermediate,), False),
        ("dgrad q,k,v", (q, kv, kv), True), ("dgrad o", (hidden,), True),
        ("dgrad up,gate", (intermediate, intermediate), True), ("dgrad down", (hidden,), True),
    ]


def arch_widths(arch: str) -> tuple[int, int, int, int]:
    """(hidden, intermediate, query width, key/value width) of a dense architecture we build."""
    from jobs.training.models.specs import ARCHITECTURES

    a = ARCHITECTURES[arch]
    head = a.get("head_dim") or a["hidden_size"] // a["num_attention_heads"]
    return a["hidden_size"], a["intermediate_size"], a["num_attention_heads"] * head, a["num_key_value_heads"] * head


def dense_archs() -> list[str]:
    from jobs.training.models.specs import ARCHITECTURES

    return sorted(n for n, a in ARCHITECTURES.items() if "intermediate_size" in a and "num_key_value_heads" in a
                  and not any("expert" in k for k in a))


def _time_us(fn: Callable[[], Any], reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def _one_call(name: str, widths: tuple[int, ...], scaled: bool, tokens: int, reps: int,
              inductor: tuple[Any, Any], g: Any) -> dict[str, Any]:
    import torch

    from jobs.training.fp8.matmul import quant_rows_ref
    from jobs.training.fp8.quant_kernel import quant_rows

    ts = [torch.randn(tokens, w, device="cuda", dtype=torch.bfloat16, generator=g) for w in widths]
    ss = [torch.rand(1, w, device="cuda", generator=g) * 1e-3 if scaled else torch.ones(1, w, device="cuda")
          for w in widths]
    args = [x for pair in zip(ts, ss, strict=True) for x in pair]
    cat = torch.cat([t.float() * s for t, s in zip(ts, ss, strict=True)], dim=1)
    ref = quant_rows_ref(cat)
    q, s = quant_rows(ts, ss if scaled else None)
    d = q.view(torch.uint8) != ref[0].view(torch.uint8)
    exact = (cat.double() / ref[1].double())[d]  # where the codes differ: the exact quotient and the midpoint
    mid = (q.double()[d] + ref[0].double()[d]) / 2
    del cat
    moved = sum(t.numel() for t in ts) * 3 + tokens * 4  # read bf16, write e4m3, write the scale
    t_ours = _time_us(lambda: quant_rows(ts, ss if scaled else None), reps)
    t_ind = _time_us(lambda: inductor[0](*args) if scaled else inductor[1](ts[0]), reps)
    return {
        "call": name, "widths": list(widths), "tokens": tokens,
        "triton_us": round(t_ours, 1), "inductor_us": round(t_ind, 1),
        "triton_gb_s": round(moved / t_ours / 1e3, 1), "inductor_gb_s": round(moved / t_ind / 1e3, 1),
        "speedup": round(t_ind / t_ours, 2),
        "triton_host_us": round(_host_us(lambda: quant_rows(ts, ss if scaled else None)), 1),
        "scales_identical": bool(torch.equal(s, ref[1])),
        "values_differing": int(d.sum()),
        "differing_off_a_tie": int(((exact - mid).abs() > 1e-6 * mid.abs()).sum()),
    }


def _host_us(fn: Callable[[], Any], calls: int = 50) -> float:
    """The host's time to launch one call (the GPU queue absorbs them; synchronised after)."""
    import time

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def measure(arch: str, tokens: int, reps: int) -> dict[str, Any]:
    """Each call of one layer timed both ways, Inductor compiling what the FP8 path compiled before
    (the reference; with the column scales and the `cat` for the dgrad operands)."""
    import torch

    from jobs.training.fp8.matmul import quant_rows_ref

    def inductor_fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ts, ss = args[0::2], args[1::2]
        return quant_rows_ref(torch.cat([t.float() * s for t, s in zip(ts, ss, strict=True)], dim=1))

    inductor = (torch.compile(inductor_fn, dynamic=True), torch.compile(quant_rows_ref, dynamic=True))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [_one_call(name, widths, scaled, tokens, reps, inductor, g)
            for name, widths, scaled in layer_calls(*arch_widths(arch))]
    total_ours = sum(r["triton_us"] for r in rows)
    total_ind = sum(r["inductor_us"] for r in rows)
    return {"arch": arch, "tokens": tokens, "reps": reps, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__, "calls": rows,
            "layer_triton_us": round(total_ours, 1), "layer_inductor_us": round(total_ind, 1),
            "layer_speedup": round(total_ind / total_ours, 2)}


def table(result: dict[str, Any]) -> str:
    head = f"{'call':<16} {'widths':<20} {'triton us':>10} {'inductor us':>12} {'triton GB/s':>12} " \
           f"{'inductor GB/s':>14} {'x':>6} {'same':>10} {'host us':>8}"
    lines = [f"{result['arch']}, {result['tokens']} tokens per step, {result['gpu']} "
             f"(torch {result['torch']}, triton {result['triton']}; median of {result['reps']})", head]
    for r in result["calls"]:
        same = "yes" if r["scales_identical"] and not r["values_differing"] else \
            f"{r['values_differing']} ties" if r["scales_identical"] and not r["differing_off_a_tie"] else "NO"
        lines.append(f"{r['call']:<16} {r['widths']!s:<20} {r['triton_us']:>10} {r['inductor_us']:>12} "
                     f"{r['triton_gb_s']:>12} {r['inductor_gb_s']:>14} {r['speedup']:>6} {same:>10} "
                     f"{r['triton_host_us']:>8}")
    lines.append(f"{'one layer':<16} {'':<20} {result['layer_triton_us']:>10} {result['layer_inductor_us']:>12} "
                 f"{'':>12} {'':>14} {result['layer_speedup']:>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks fp8-quant", description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=dense_archs(), default="llama3.1-8b")
    p.add_argument("--tokens", type=int, default=7168, help="tokens per step (the 8B's FP8 step under 40 GB: 7168)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    if not torch.cuda.is_available():
        p.error("fp8-quant times CUDA kernels: no CUDA device here")
    result = measure(a.arch, a.tokens, a.reps)
    print(table(result))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0
