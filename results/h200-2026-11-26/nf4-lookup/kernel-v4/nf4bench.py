# ruff: noqa  (device micro-benchmark)
"""NF4 -> e4m3 kernel speed at the 32B's gate/up and down shapes: forward [N, K] and transposed, against bitsandbytes'
dequantize_4bit (to bf16) and the compiled transpose of an e4m3 copy; GB/s over the bytes each must move."""
import sys, time, torch, bitsandbytes.functional as bnbf
from jobs.training.fp8_nf4 import NF4Source
from jobs.training.fp8 import FP8Base, transpose_cat, _NF4, E4M3
import importlib, os; sys.path.insert(0, os.path.join(os.getcwd(), "results/tmp"))
variants = sys.argv[1:] or ["jobs.training.nf4_fp8_kernel"]

def t(fn, it=10):
    fn(); torch.cuda.synchronize(); a = time.perf_counter()
    for _ in range(it): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - a) / it * 1e3

for n, k in ((25600, 5120), (5120, 25600), (4096, 4096)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    src = NF4Source(packed, qs.absmax, qs.code, qs.blocksize, (n, k), (qs.state2.absmax, qs.state2.code, qs.state2.blocksize, float(qs.offset)))
    dense = bnbf.dequantize_4bit(packed, qs)
    copy = FP8Base.from_weight(dense)
    p = n * k
    ms_bnb = t(lambda: bnbf.dequantize_4bit(packed, qs))
    ms_tr = t(lambda: transpose_cat([copy.weight]))
    print(f"{n}x{k}: bnb dequantize_4bit {ms_bnb:.3f} ms ({p*2.5/ms_bnb/1e6:.0f} GB/s), compiled transpose {ms_tr:.3f} ms ({p*2/ms_tr/1e6:.0f} GB/s)")
    for v in variants:
        mod = importlib.import_module(v)
        out = torch.empty(n, k, dtype=E4M3, device="cuda"); outt = torch.empty(k, n, dtype=E4M3, device="cuda")
        f = lambda: mod.nf4_to_fp8(src, copy.weight_scale, out)
        ft = lambda: mod.nf4_to_fp8(src, copy.weight_scale, outt.t())
        ms, mst = t(f), t(ft)
        ok = torch.equal(out.view(torch.uint8), copy.weight.view(torch.uint8)); okt = torch.equal(outt.view(torch.uint8), copy.weight.view(torch.uint8).t())
        print(f"   {v}: forward {ms:.3f} ms ({p*1.5/ms/1e6:.0f} GB/s) exact {ok}; transposed {mst:.3f} ms ({p*1.5/mst/1e6:.0f} GB/s) exact {okt}", flush=True)
    if os.environ.get("NF4_SWEEP"):  # tile configurations of the committed kernel
        mod = importlib.import_module("jobs.training.nf4_fp8_kernel")
        keep = (mod.BLOCK_N, mod.BLOCK_K, mod.NUM_WARPS)
        for bn, bk, nw in ((32, 256, 4), (64, 256, 8), (16, 256, 4), (32, 512, 8), (64, 512, 8), (128, 256, 8)):
            mod.BLOCK_N, mod.BLOCK_K, mod.NUM_WARPS = bn, bk, nw
            out = torch.empty(n, k, dtype=E4M3, device="cuda"); outt = torch.empty(k, n, dtype=E4M3, device="cuda")
            ms = t(lambda: mod.nf4_to_fp8(src, copy.weight_scale, out)); mst = t(lambda: mod.nf4_to_fp8(src, copy.weight_scale, outt.t()))
            ok = torch.equal(out.view(torch.uint8), copy.weight.view(torch.uint8)); okt = torch.equal(outt.view(torch.uint8), copy.weight.view(torch.uint8).t())
            print(f"   sweep {bn}x{bk} w{nw}: forward {ms:.3f} ms ({p*1.5/ms/1e6:.0f} GB/s) exact {ok}; transposed {mst:.3f} ms ({p*1.5/mst/1e6:.0f} GB/s) exact {okt}", flush=True)
        mod.BLOCK_N, mod.BLOCK_K, mod.NUM_WARPS = keep
