# ruff: noqa  (device sweep, issue 16: multi-row quantisation and the LoRA add kernel against today's kernel and addmm_)
import json, sys, itertools
import torch
sys.path.insert(0, "results/tmp")
from jobs.training.fp8_quant_kernel import quant_rows
from quant_v2 import quant_rows_v2
from lora_add_v1 import lora_add

dev = "cuda"


def timeit(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(n):
        fn()
    ev[1].record(); torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / n * 1e3


res = {"gpu": torch.cuda.get_device_name(), "quant": [], "lora": []}
shapes = [(7168, [4096], False), (7168, [14336], False), (7168, [4096, 1024, 1024], True), (7168, [14336, 14336], True),
          (7168, [4096], True), (2560, [5120], False), (2560, [8192], False), (2560, [25600], False),
          (2560, [8192, 1024, 1024], True), (2560, [25600, 25600], True), (2560, [5120], True)]
for m, widths, scaled in shapes:
    ts = [torch.randn(m, w, device=dev, dtype=torch.bfloat16) * torch.logspace(-3, 3, m, device=dev)[:, None].to(torch.bfloat16)
          for w in widths]
    scs = [torch.rand(1, w, device=dev) + 0.5 for w in widths] if scaled else None
    q0, s0 = quant_rows(ts, scs)
    byts = sum(m * w * 3 for w in widths)
    base = timeit(lambda: quant_rows(ts, scs))
    row = {"m": m, "widths": widths, "scaled": scaled, "old_us": base, "old_GBps": byts / base / 1e3, "configs": []}
    padded = sum(max(16, 1 << (w - 1).bit_length()) for w in widths)
    for rows, warps, regs, block in itertools.product((1, 2, 4, 8), (4, 8, 16), (True, False), (1024, 2048, 4096)):
        if regs and block != 1024:
            continue
        if regs and rows * padded / (32 * warps) > 128:
            continue
        if not regs and rows * block / (32 * warps) > 64:
            continue
        try:
            q, s = quant_rows_v2(ts, scs, rows=rows, in_regs=regs, block=block, warps=warps)
            same = bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0))
            us = timeit(lambda: quant_rows_v2(ts, scs, rows=rows, in_regs=regs, block=block, warps=warps))
            row["configs"].append({"rows": rows, "warps": warps, "regs": regs, "block": block, "us": us, "same": same})
        except Exception as e:
            row["configs"].append({"rows": rows, "warps": warps, "regs": regs, "block": block, "error": repr(e)[:200]})
    ok = [c for c in row["configs"] if c.get("same")]
    best = min(ok, key=lambda c: c["us"]) if ok else None
    row["best"] = best
    if best:
        row["best_GBps"] = byts / best["us"] / 1e3
    res["quant"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "configs"}), "bad:", sum(1 for c in row["configs"] if not c.get("same")), flush=True)

for m, n, r, bt in ((7168, 4096, 16, False), (7168, 14336, 16, False), (7168, 1024, 16, False), (7168, 4096, 48, True),
                    (7168, 14336, 16, True), (2560, 5120, 16, False), (2560, 25600, 16, False), (2560, 25600, 64, False),
                    (2560, 5120, 48, True), (7168, 4096, 64, False)):
    out0 = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    xa = torch.randn(m, r, device=dev, dtype=torch.bfloat16)
    b = (torch.randn(r, n, device=dev, dtype=torch.bfloat16) if bt else torch.randn(n, r, device=dev, dtype=torch.bfloat16)) * 0.1
    bmat = b if bt else b.t()
    ref = out0.clone().addmm_(xa, bmat, alpha=0.5)
    o = out0.clone()
    base = timeit(lambda: o.addmm_(xa, bmat, alpha=0.5))
    row = {"m": m, "n": n, "r": r, "b_t": bt, "addmm_us": base, "addmm_GBps": m * n * 4 / base / 1e3, "configs": []}
    for bm, bn, warps in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
        try:
            o = out0.clone(); lora_add(o, xa, b, 0.5, bm=bm, bn=bn, warps=warps, b_t=bt)
            diff = (o.float() - ref.float()).abs().max().item()
            ulp = ((o.float() - ref.float()).abs() > ref.float().abs() * 2 ** -7 + 1e-6).sum().item()
            us = timeit(lambda: lora_add(o, xa, b, 0.5, bm=bm, bn=bn, warps=warps, b_t=bt))
            row["configs"].append({"bm": bm, "bn": bn, "warps": warps, "us": us, "maxdiff": diff, "over_1ulp": ulp})
        except Exception as e:
            row["configs"].append({"bm": bm, "bn": bn, "warps": warps, "error": repr(e)[:200]})
    ok = [c for c in row["configs"] if "us" in c]
    row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
    if row["best"]:
        row["best_GBps"] = m * n * 4 / row["best"]["us"] / 1e3
    res["lora"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
