"""budget: is the plan's arithmetic right? Calibrate our path on one profile (tok/s at the chosen
budget), then predict the time of two data sets of other sizes, train them, and compare."""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job, load_ours
from benchmarks.stacks.ours import run_ours
from jobs.training.models.synthetic import make_samples


def run(s: BenchSettings, job: Job) -> None:
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    vocab = vocab_size(job.model)
    model, _tok, info = load_ours(s, job.model, gc=False, cache=s.state_dir is not None, max_seq=s.max_budget)
    cal = run_ours(model, s, ["wiki"], vocab, label="calibrate")[0]
    if cal.get("error"):
        raise SystemExit(f"budget: calibration failed: {cal['error']}")
    tps, budget = cal["real_tok_s"], cal["token_budget"]
    print(f"calibrated: {tps:,.0f} tok/s at {budget} tokens/step", flush=True)
    out: dict[str, Any] = {"calibration": cal, "runs": []}
    opt = make_optimizer(model)
    for prof, target_s in zip(("alpaca", "wiki"), s.budget_seconds, strict=True):
        samples = make_samples(prof, int(tps * target_s), vocab=vocab, seed=s.seed + 7)
        tokens = sum(x.n_tokens for x in samples)
        predicted = tokens / tps
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in packed_batches(samples, tokens_per_step=budget):
            train_step(model, b, opt)
        torch.cuda.synchronize()  # train_step returns before the GPU has run its last step
        actual = time.perf_counter() - t0
        r = {
            "profile": prof,
            "samples": len(samples),
            "tokens": tokens,
            "predicted_s": round(predicted, 1),
            "actual_s": round(actual, 1),
            "error_percent": round(100 * (actual - predicted) / predicted, 1),
        }
        print("BUDGET", json.dumps(r), flush=True)
        out["runs"].append(r)
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / f"budget-{s.arch or job.model.name}.json").write_text(
        json.dumps({**out, "load": info, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1, default=str)
    )
