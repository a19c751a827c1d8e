# ruff: noqa  (device probe: host CPU and launch cost, to tell hosts apart when a launch-bound FP8 step differs)
import json, sys, time, platform
import torch
from jobs.training.fp8_quant_kernel import quant_rows
from jobs.training.lora_add_kernel import lora_add_
x = torch.randn(64, 64, device="cuda")
def rate(fn, n=5000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
xb = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); xa = torch.randn(4096, 16, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 16, device="cuda", dtype=torch.bfloat16)
out = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
       "us_per_add": rate(lambda: x.add_(1.0)), "us_per_mm": rate(lambda: x @ x),
       "us_per_quant_triton": rate(lambda: quant_rows([xb])),
       "us_per_lora_add_triton_4096sq": rate(lambda: lora_add_(big, xa, b, 0.5), 500),
       "us_per_addmm_4096sq": rate(lambda: big.addmm_(xa, b.t(), alpha=0.5), 500)}
print(json.dumps(out)); json.dump(out, open(sys.argv[1], "w"))
