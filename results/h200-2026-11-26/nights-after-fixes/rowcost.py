# ruff: noqa  (the device script as it ran: cache locations are set before the imports that read them)
"""issue 11/16: what a packed step's time depends on besides its tokens. One process, the 8B at 8,192 tokens
a step; each composition timed 8 s (warm-up until settled, as calibrate): samples of one length L, short
samples with one 2,048-token sample per row, the alpaca profile next-fit (calibrate's rows) and the same
samples sorted by length before packing."""
import json, random, sys, time
from pathlib import Path
out = Path(sys.argv[1])
from jobs.training.unsloth_backend import setup_caches
setup_caches(Path("/tmp/rowcost-cache"))
from jobs.training.unsloth_import import import_unsloth
import_unsloth()
import torch
from jobs.contract.calibration import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training.config import TrainConfig
from jobs.training.load import load_for_training
from jobs.training.optim import build_optimizer
from jobs.training.probe import timed_steps
from jobs.training.packing import packed_batches
from jobs.training.synthetic import make_samples
cfg = TrainConfig(backend="auto", batching="packed", compute="bf16", lora_rank=16, lora_alpha=16, max_seq_length=2048,
                  gradient_checkpointing=False)
loaded = load_for_training(Path("/tmp/models/llama3.1-8b"), cfg, adapter=None,
                           shape=StepShape(tokens_per_step=8192, gradient_checkpointing=False, basis="x"),
                           cache_dir=Path("/tmp/rowcost-cache"), max_vram_gb=40)
vocab = len(loaded.tokenizer)
opt = build_optimizer(loaded.model, cfg, loaded.optim, device=loaded.device)
r = random.Random(7)
def sample(i, n):
    ids = [r.randrange(16, vocab - 16) for _ in range(n)]
    return TokenizedSample(i, ids, list(ids))
def rows_of(lengths_per_row, n_rows=8):
    out, i = [], 0
    for _ in range(n_rows):
        for n in lengths_per_row:
            out.append(sample(i, n)); i += 1
    return out
comps = {}
for L in (32, 85, 128, 256, 1024, 2048):
    comps[f"uniform{L}"] = rows_of([L] * (8192 // L))
comps["85+tail2048"] = rows_of([2048] + [85] * ((8192 - 2048) // 85))
comps["85+tail512"] = rows_of([512] + [85] * ((8192 - 512) // 85))
alp = make_samples("alpaca", 40 * 8192, vocab=vocab, cap=2048, seed=1)
comps["alpaca-nextfit"] = alp
comps["alpaca-sorted"] = sorted(alp, key=lambda s: s.n_tokens)
res = {}
order = list(comps) + ["uniform85", "alpaca-nextfit"]  # two repeated last: drift check
for k, name in enumerate(order):
    data = comps[name]
    rows = list(packed_batches(data, tokens_per_step=8192))
    th = timed_steps(loaded.model, data, 8192, opt, seconds=8)
    key = name if name not in res else name + "-again"
    res[key] = {"tokens_per_second": round(th.tokens_per_second, 1), "steps": th.steps,
                "mean_row_tokens": round(sum(b.real_tokens for b in rows) / len(rows), 1),
                "mean_samples_per_row": round(sum(len(b.sample_ids) for b in rows) / len(rows), 1),
                "sum_len2_per_token": round(sum(s.n_tokens ** 2 for s in data) / sum(s.n_tokens for s in data), 1)}
    print(key, res[key], flush=True)
out.write_text(json.dumps(res, indent=1))
