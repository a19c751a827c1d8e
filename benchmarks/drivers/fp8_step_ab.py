"""Before/after of the FP8 8B step's host-side changes in one process (issue 44): one load, then calibrate's own
timed windows (jobs.training.probe.time_profiles) with each change switched off and on by its variable, in
turns (off, on, off, on), then 3 profiled steps of each (`--profile-variants`; benchmarks.profiling: idle
stretches, host waits, the timeline). One load, so the variants see the same card, clocks and kernels;
`nightshift calibrate` gives the product's figure.

  python -m benchmarks.drivers.fp8_step_ab OUT_DIR [--arch llama3.1-8b] [--tokens 6912] [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# variable -> (value that turns the change off, on): the LoRA casts after the optimizer step, the packed labels'
# lengths without a stream sync, train_step without a synchronize at its end
SWITCHES = {"NIGHTSHIFT_FP8_CAST_CACHE": ("0", "1"), "NIGHTSHIFT_PACKED_LABELS_SYNC": ("1", "0"),
            "NIGHTSHIFT_STEP_SYNC": ("1", "0")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="llama3.1-8b")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--tokens", type=int, default=6912)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profiles", default="alpaca,wiki")
    ap.add_argument("--profile-variants", default="off,on", help="variants to run under torch.profiler after")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)

    from benchmarks import profiling
    from benchmarks.model import resolve_model, vocab_size
    from benchmarks.settings import BenchSettings
    from benchmarks.stacks.common import load_ours
    from jobs.training.fp8.enable import CAPTURE_TOKENS, enable_fp8
    from jobs.training.fp8.sample_data import data_files, sample_tokens
    from jobs.training.models.synthetic import CAP, make_samples
    from jobs.training.packing import packed_batches
    from jobs.training.probe import time_profiles
    from jobs.training.step import make_optimizer

    s = BenchSettings(arch=a.arch, models_dir=a.models_dir)
    path = resolve_model(s).path
    model, tok, info = load_ours(s, path, gc=False, cache=False, max_seq=s.max_budget)
    ids, source = sample_tokens(tok, data_files(None, []), n=CAPTURE_TOKENS)
    out = enable_fp8(model, device="cuda", tokens=ids, activations=source, unsloth=True, source_dir=path,
                     vocab=vocab_size(path))
    print("fp8:", out.error, out.patch.get("status") if out.patch else None, "labels:", info.get("packed_labels"),
          flush=True)
    opt = make_optimizer(model)
    vocab = vocab_size(path)
    profiles = a.profiles.split(",")
    results: list[dict[str, object]] = []
    first = True
    for r in range(a.rounds):
        for variant in ("off", "on"):
            for var, vals in SWITCHES.items():
                os.environ[var] = vals[variant == "on"]
            t = time.perf_counter()
            rates = time_profiles(model, opt, a.tokens, profiles, vocab=vocab, cap=CAP, seconds=a.seconds,
                                  first_warmup_seconds=30.0 if first else 2.0)
            first = False
            row = {"round": r, "variant": variant, "seconds": round(time.perf_counter() - t, 1),
                   **{p: round(x.tokens_per_second) for p, x in rates.items()},
                   "stalls": {p: x.stalls for p, x in rates.items()}}
            print(json.dumps(row), flush=True)
            results.append(row)
    for variant in a.profile_variants.split(","):
        for var, vals in SWITCHES.items():
            os.environ[var] = vals[variant == "on"]
        for p in profiles:
            samples = make_samples(p, a.tokens * 5, vocab=vocab, seed=7)
            batches = list(packed_batches(samples, tokens_per_step=a.tokens))[:4]
            summ = profiling.profile_steps(model, batches, opt, path=a.out / f"prof.{variant}.{p}.txt",
                                           title=f"{variant} {p}, <= {a.tokens} tokens", top=40)
            print(variant, p, json.dumps({k: summ[k] for k in ("gpu_span_ms", "gpu_busy_ms", "gpu_idle_share",
                                                              "launches_per_step", "host_waits_per_step")}),
                  flush=True)
    (a.out / "ab.json").write_text(json.dumps({"windows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
