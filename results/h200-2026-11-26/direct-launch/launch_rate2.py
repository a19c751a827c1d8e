# ruff: noqa  (device probe: CPU cost of our Triton launches, direct against the JIT path, and of torch ops, on this host)
import json, sys, time
import torch
from jobs.training import fp8_quant_kernel as fq, lora_add_kernel as la
from jobs.training.fp8_quant_kernel import quant_rows
from jobs.training.lora_add_kernel import lora_add_
def rate(fn, n=3000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
x = torch.randn(64, 64, device="cuda"); xb = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); xa = torch.randn(4096, 16, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 16, device="cuda", dtype=torch.bfloat16)
out = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"), "us_per_add": rate(lambda: x.add_(1.0))}
out["quant_direct_us"] = rate(lambda: quant_rows([xb])); out["lora_add_direct_us_4096sq"] = rate(lambda: lora_add_(big, xa, b, 0.5), 500)
fq._LAUNCH.failed = la._LAUNCH.failed = "probe: the JIT path"
out["quant_jit_us"] = rate(lambda: quant_rows([xb])); out["lora_add_jit_us_4096sq"] = rate(lambda: lora_add_(big, xa, b, 0.5), 500)
print(json.dumps(out)); json.dump(out, open(sys.argv[1], "w"))
