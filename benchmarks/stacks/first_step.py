"""first_step (faststart mode): a night's start — load (NF4 base cache or not), one packed batch, one step.

Times are from the worker's launch, so the second "night" shows what the caches save.
"""

from __future__ import annotations

import time

from benchmarks.measure import append_row
from benchmarks.model import vocab_size
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job, load_ours
from jobs.training.models.synthetic import make_samples


def run(s: BenchSettings, job: Job) -> None:
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, _tok, info = load_ours(s, job.model, gc=False, cache=True, max_seq=s.max_budget)
    t_loaded = time.time()
    samples = make_samples("alpaca", 4096, vocab=vocab_size(job.model), seed=s.seed)
    b = next(packed_batches(samples, tokens_per_step=4096))
    opt = make_optimizer(model)
    st = train_step(model, b, opt)
    now = time.time()
    st2 = train_step(model, next(packed_batches(samples[len(b.sample_ids) :], tokens_per_step=4096)), opt)
    append_row(
        job.rows,
        {
            "mode": "faststart",
            "first_step_s": round(now - job.t_launch, 2),
            "launch_to_loaded_s": round(t_loaded - job.t_launch, 2),
            "first_step_seconds": round(st.seconds, 2),
            "second_step_seconds": round(st2.seconds, 3),
            "load": info,
        },
    )
