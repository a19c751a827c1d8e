# ruff: noqa  (device diagnostic, not part of the package)
"""Where the GPU waits: each idle gap of a torch.profiler chrome trace (>= MIN_US between kernels), attributed to
the CPU ops around the launch of the kernel that ends it (innermost op, outermost op, autograd Function if any),
and whether a host sync ended just before that launch. Usage: python gaps.py trace.json[.gz] [steps]"""
import bisect, collections, gzip, json, sys

MIN_US = 10.0
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize",
         "cuStreamSynchronize", "cuCtxSynchronize")


def load(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main(path, steps=3):
    ev = [e for e in load(path) if e.get("ph") == "X"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launch = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    cpu = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            cpu[e["tid"]].append(e)
    syncs = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNCS:
            syncs[e["tid"]].append((e["ts"] + e["dur"], e["name"], e["dur"]))
    for t in cpu:
        cpu[t].sort(key=lambda e: e["ts"])
    starts = {t: [e["ts"] for e in cpu[t]] for t in cpu}
    for t in syncs:
        syncs[t].sort()
    span0, span1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    end = gpu[0]["ts"] + gpu[0]["dur"]
    by = collections.Counter(); n = collections.Counter(); total = 0.0; sync_gap = 0.0
    examples = collections.defaultdict(list)
    for e in gpu[1:]:
        gap = e["ts"] - end
        if gap >= MIN_US:
            total += gap
            l = launch.get(e["args"].get("correlation"))
            key = "?"
            if l is not None:
                t, ts = l["tid"], l["ts"]
                i = bisect.bisect_right(starts.get(t, []), ts)
                stack = [c for c in cpu.get(t, [])[max(0, i - 4000):i] if c["ts"] <= ts <= c["ts"] + c["dur"]]
                names = [c["name"] for c in stack]
                fn = next((x for x in names if "Backward" in x or x.startswith("FP8") or "Optimizer" in x
                           or x.startswith("autograd::engine")), None)
                inner = names[-1] if names else "-"
                outer = names[0] if names else "-"
                s = syncs.get(t, [])
                j = bisect.bisect_right(s, (ts, "~", 0)) - 1
                after_sync = j >= 0 and ts - s[j][0] < gap + 50
                key = f"{'SYNC ' if after_sync else ''}{fn or outer} > {inner}"
                if after_sync:
                    sync_gap += gap
            by[key] += gap; n[key] += 1
            if len(examples[key]) < 2:
                examples[key].append(round(gap, 1))
        end = max(end, e["ts"] + e["dur"])
    busy = sum(e["dur"] for e in gpu)
    print(f"GPU span {(span1 - span0) / 1e3 / steps:.1f} ms/step, idle in gaps >= {MIN_US} us: "
          f"{total / 1e3 / steps:.1f} ms/step ({total / (span1 - span0):.1%}), of it right after a host sync "
          f"{sync_gap / 1e3 / steps:.1f} ms/step; kernels {len(gpu) / steps:.0f}/step")
    for k, v in by.most_common(40):
        print(f"{v / 1e3 / steps:8.2f} ms/step {n[k] / steps:7.1f} gaps/step  {k[:150]}  e.g. {examples[k]} us")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
