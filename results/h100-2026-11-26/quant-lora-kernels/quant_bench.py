# ruff: noqa  (device micro-benchmark, issue 16: where the FP8 step's quantisation and LoRA adds stand against bandwidth)
import json, sys
import torch
from jobs.training.fp8_quant_kernel import quant_rows

dev = "cuda"
M = 7168


def timeit(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(n):
        fn()
    ev[1].record(); torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / n


rows = []
for name, widths, scaled in (("x qkv/mlp", [4096], False), ("h down", [14336], False),
                             ("dgrad qkv", [4096, 1024, 1024], True), ("dgrad gate_up", [14336, 14336], True),
                             ("dgrad o/down", [4096], True)):
    ts = [torch.randn(M, w, device=dev, dtype=torch.bfloat16) for w in widths]
    scs = [torch.rand(1, w, device=dev) + 0.5 for w in widths] if scaled else None
    ms = timeit(lambda: quant_rows(ts, scs))
    byts = sum(M * w * 3 for w in widths)
    rows.append({"what": name, "widths": widths, "us": ms * 1e3, "GBps": byts / ms / 1e6})
    print(rows[-1], flush=True)
# the LoRA B product added into a base output (memory-bound addmm_)
for n in (4096, 14336):
    o = torch.randn(M, n, device=dev, dtype=torch.bfloat16)
    xa = torch.randn(M, 16, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, 16, device=dev, dtype=torch.bfloat16)
    ms = timeit(lambda: o.addmm_(xa, b.t(), alpha=0.5))
    rows.append({"what": f"addmm_ lora B into [M,{n}]", "us": ms * 1e3, "GBps": M * n * 4 / ms / 1e6}); print(rows[-1], flush=True)
    xb = torch.randn(M, 4096 if n == 4096 else 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(48, 4096, device=dev, dtype=torch.bfloat16)
    ms = timeit(lambda: xb @ a.t())
    rows.append({"what": "x A^T [M,4096]x[4096,48]", "us": ms * 1e3}); print(rows[-1], flush=True)
# lm_head: bf16 vs FP8 GEMM at the 8B's shape, forward and input gradient
x = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16) * 0.02
ms = timeit(lambda: x @ w.t(), 10)
rows.append({"what": "lm_head bf16 fwd", "ms": ms, "TFLOPs": 2 * M * 4096 * 128256 / ms / 1e9}); print(rows[-1], flush=True)
xq = x.to(torch.float8_e4m3fn); wq = w.to(torch.float8_e4m3fn)
one = torch.ones(M, 1, device=dev); onew = torch.ones(1, 128256, device=dev)
ms = timeit(lambda: torch._scaled_mm(xq, wq.t(), one, onew, out_dtype=torch.bfloat16, use_fast_accum=True), 10)
rows.append({"what": "lm_head fp8 fwd", "ms": ms, "TFLOPs": 2 * M * 4096 * 128256 / ms / 1e9}); print(rows[-1], flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
