"""Where a training step's time goes: a few steps under torch.profiler, summarised.

Reports the top kernels by GPU time, how many kernels a step launches, and the GPU's idle share: the
part of the GPU timeline (first kernel start to last kernel end) in which no kernel ran. A large idle
share with short kernels means the GPU waits for the CPU to launch them (what the published GPT-OSS
run showed); a small one means the kernels themselves are the cost. The profiler slows the CPU side
a little, so the idle share it shows is an upper bound of the unprofiled one.
"""

from __future__ import annotations

import gzip
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
         "cudaMemcpyAsync")  # host calls that may wait for the GPU (a copy waits when it is blocking or to the host)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


# (category, name fragments), checked in this order: the first match wins (FP8 GEMMs before GEMMs, the
# quantisation's amax kernels before the element-wise ones)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp8 gemm", ("e4m3", "f8f8", "qqtst", "_scaled_mm", "fp8")),
    ("nf4 dequant", ("kdequantize", "dequantize", "nf4")),
    ("attention", ("flash", "fmha", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "ampere_")),
    ("quantise (amax, scale)", ("amax", "clamp_div")),
    ("cross entropy", ("cross_entropy", "logsumexp")),
    ("optimizer", ("adam", "multi_tensor", "_foreach")),
    ("norm/rope/activation", ("rms", "layernorm", "rope", "swiglu", "_fg_kernel", "silu", "gelu")),
    ("copy/cast", ("copy", "cat", "transpose")),
)


def kernel_category(name: str) -> str:
    """Which part of a step a CUDA kernel belongs to, from its name (CATEGORIES' order); else "other"."""
    low = name.lower()
    return next((cat for cat, parts in CATEGORIES if any(p in low for p in parts)), "other")


def by_category(kernels: Sequence[tuple[str, float]]) -> list[dict[str, Any]]:
    """[(kernel name, device time)] -> [{category, ms, share}], largest first (times in microseconds)."""
    sums: dict[str, float] = {}
    for name, us in kernels:
        sums[kernel_category(name)] = sums.get(kernel_category(name), 0.0) + us
    total = sum(sums.values()) or 1.0
    return [{"category": c, "ms": round(us / 1e3, 2), "share": round(us / total, 4)}
            for c, us in sorted(sums.items(), key=lambda kv: kv[1], reverse=True)]


def idle_gaps(kernels: Sequence[tuple[str, float, float]], min_us: float = 20.0, top: int = 12) -> dict[str, Any]:
    """The GPU's idle stretches between kernels [(name, start, end)] (microseconds): how many, their total, and the
    longest with the kernels either side (where in the step the GPU waited for the host)."""
    ks = sorted(kernels, key=lambda k: k[1])
    gaps: list[tuple[float, str, str]] = []
    end, prev = None, ""
    for name, s, e in ks:
        if end is not None and s - end >= min_us:
            gaps.append((s - end, prev, name))
        if end is None or e > end:
            end, prev = e, name
    gaps.sort(reverse=True)
    return {"count": len(gaps), "ms": round(sum(g for g, _, _ in gaps) / 1e3, 2), "min_us": min_us,
            "longest": [{"us": round(g, 1), "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]}


def profile_steps(model: Any, batches: Sequence[Any], optimizer: Any, *, path: Path | None, title: str,
                  top: int = 25) -> dict[str, Any]:
    """One warm-up step, then `batches[1:]` under the profiler. Writes a text report to `path`."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from jobs.training.step import train_step

    train_step(model, batches[0], optimizer)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for b in batches[1:]:
            train_step(model, b, optimizer)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = max(1, len(batches) - 1)
    events = p.events()
    on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]  # kernels (the ops' rows repeat them)
    gpu = [(e.time_range.start, e.time_range.end) for e in on_gpu]
    launches = sum(1 for e in events if e.name in LAUNCHES)
    syncs = {n: sum(1 for e in events if e.name == n) / steps for n in SYNCS}
    gaps = idle_gaps([(e.name, e.time_range.start, e.time_range.end) for e in on_gpu])
    span = (max(e for _, e in gpu) - min(s for s, _ in gpu)) if gpu else 0.0
    busy = busy_time(gpu)
    ka = p.key_averages()
    kernels = sorted((k for k in ka if getattr(k, "self_device_time_total", 0) > 0),
                     key=lambda k: k.self_device_time_total, reverse=True)
    total_dev = sum(e.time_range.end - e.time_range.start for e in on_gpu) or 1.0  # kernels only: no op twice
    summary = {
        "steps": steps, "tokens": sum(b.real_tokens for b in batches[1:]), "wall_s": round(wall, 3),
        "gpu_span_ms": round(span / 1e3, 1), "gpu_busy_ms": round(busy / 1e3, 1),
        "gpu_idle_share": round(1 - busy / span, 4) if span else None,
        "kernels_per_step": round(len(gpu) / steps), "launches_per_step": round(launches / steps),
        "host_waits_per_step": {k: v for k, v in syncs.items() if v}, "idle_gaps": gaps,
        "categories": by_category([(e.name, e.time_range.end - e.time_range.start) for e in on_gpu]),
        "top_kernels": [{"name": k.key[:120], "calls": k.count, "ms": round(k.self_device_time_total / 1e3, 2),
                         "share": round(k.self_device_time_total / total_dev, 4)} for k in kernels[:top]],
    }
    if path is not None:
        head = (f"{title}: {steps} profiled steps, {summary['tokens']} tokens, wall {wall:.2f} s; GPU timeline "
                f"{summary['gpu_span_ms']} ms, busy {summary['gpu_busy_ms']} ms, idle share "
                f"{summary['gpu_idle_share']}; {summary['kernels_per_step']} kernels and "
                f"{summary['launches_per_step']} launch calls per step")
        cats = "\n".join(f"  {c['share']:6.1%}  {c['ms']:10.1f} ms  {c['category']}" for c in summary["categories"])
        head += "\n\ntime by category (kernel names):\n" + cats
        head += f"\n\nhost calls that may wait for the GPU, per step: {summary['host_waits_per_step']}"
        head += (f"\nidle stretches of >= {gaps['min_us']:g} us: {gaps['count']} in {steps} steps, {gaps['ms']} ms; "
                 "longest:\n" + "\n".join(f"  {g['us']:9.1f} us  after {g['after']}  before {g['before']}"
                                         for g in gaps["longest"]))
        path.write_text(head + "\n\n" + ka.table(sort_by="self_device_time_total", row_limit=top,
                                                  max_name_column_width=90))
        trace = path.with_suffix(".trace.json")
        p.export_chrome_trace(str(trace))  # the timeline itself, for where the idle stretches fall
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        trace.unlink()
    return summary
