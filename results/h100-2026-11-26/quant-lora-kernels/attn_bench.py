# ruff: noqa  (device micro-benchmark, issue 16: FA2 varlen vs cuDNN ragged attention on packed rows)
"""Time causal attention fwd+bwd over packed samples (Llama-3.1-8B heads: 32 q, 8 kv, d 128), the aten flash
varlen kernels Unsloth calls against cuDNN's ragged SDPA (K/V expanded to 32 heads), and check they agree."""
import json, sys, time
import torch

torch.manual_seed(0)
dev = "cuda"
HQ, HKV, D = 32, 8, 128
T = 7168
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
for name in ["_cudnn_attention_forward", "_cudnn_attention_backward", "_flash_attention_backward"]:
    out[name] = [str(s) for s in getattr(torch.ops.aten, name)._schemas.values()]


def lengths(mean):
    g = torch.Generator().manual_seed(1)
    ls, tot = [], 0
    while tot < T:
        n = int(max(8, min(2048, torch.empty(1).exponential_(1.0 / mean, generator=g).item())))
        n = min(n, T - tot)
        ls.append(n); tot += n
    return ls


def timeit(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(n):
        fn()
    ev[1].record(); torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / n


def flops(ls):  # causal fwd: 2 matmuls * 2 flops * L^2/2 * d * heads
    return sum(2 * 2 * l * l / 2 * D * HQ for l in ls)


res = []
for mean in (117, 861):
    ls = lengths(mean)
    cu = torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=dev)
    mx = max(ls)
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16)
    do = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    sc = D ** -0.5
    row = {"mean": mean, "samples": len(ls), "max": mx, "fwd_tflop": flops(ls) / 1e12}

    def fa_fwd():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=sc)

    o, lse, rng, unused, _ = fa_fwd()

    def fa_bwd():
        return torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cu, cu, mx, mx, 0.0, True, rng, unused, scale=sc)

    row["fa2_fwd_ms"] = timeit(fa_fwd)
    row["fa2_bwd_ms"] = timeit(fa_bwd)
    dq, dk, dv = fa_bwd()
    kx = k.repeat_interleave(HQ // HKV, dim=1)
    vx = v.repeat_interleave(HQ // HKV, dim=1)
    try:
        def cd_fwd():
            return torch.ops.aten._cudnn_attention_forward(q, kx, vx, None, cu, cu, mx, mx, True, 0.0, True, False, scale=sc)

        r = cd_fwd()
        o2, lse2, seed, off = r[0], r[1], r[6], r[7]
        row["cudnn_fwd_ms"] = timeit(cd_fwd)
        row["cudnn_out_maxdiff"] = (o2.float() - o.float()).abs().max().item()
        row["cudnn_out_shape"] = list(o2.shape); row["lse_shape"] = [list(lse.shape), list(lse2.shape)]

        def cd_bwd():
            return torch.ops.aten._cudnn_attention_backward(do, q, kx, vx, o2, lse2, seed, off, torch.empty(0, device=dev),
                                                             cu, cu, mx, mx, 0.0, True, scale=sc)

        dq2, dk2, dv2 = cd_bwd()
        row["cudnn_bwd_ms"] = timeit(cd_bwd)
        dk2 = dk2.view(T, HKV, HQ // HKV, D).sum(2); dv2 = dv2.view(T, HKV, HQ // HKV, D).sum(2)
        for nm, a, b in (("dq", dq2, dq), ("dk", dk2, dk), ("dv", dv2, dv)):
            row[f"cudnn_{nm}_maxdiff"] = (a.float() - b.float()).abs().max().item()
            row[f"{nm}_absmax"] = b.float().abs().max().item()
    except Exception as e:  # noqa
        row["cudnn_error"] = repr(e)[:600]
    # dense reference on one sample for sanity of FA2 itself
    l0 = ls[0]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:l0].transpose(0, 1).float(), kx[:l0].transpose(0, 1).float(),
                                                           vx[:l0].transpose(0, 1).float(), is_causal=True, scale=sc)
    row["fa2_vs_fp32_maxdiff"] = (o[:l0].transpose(0, 1).float() - ref).abs().max().item()
    for key in ("fa2", "cudnn"):
        if f"{key}_bwd_ms" in row:
            row[f"{key}_fwd_tflops"] = row["fwd_tflop"] / row[f"{key}_fwd_ms"] * 1e3
            row[f"{key}_bwd_tflops"] = 2.5 * row["fwd_tflop"] / row[f"{key}_bwd_ms"] * 1e3
    res.append(row)
    print(json.dumps(row), flush=True)
out["rows"] = res
json.dump(out, open(sys.argv[1], "w"), indent=1)
