# ruff: noqa  (the device script as it ran: cache locations are set before the imports that read them)
"""issue 11: why calibrate reads ~8 % under the nights. One process per variant (a fresh compile cache each):
  direct       load at 8,192 tokens, timed steps at 8,192 first (the night's order)
  calib        load at 32,768 (calibrate's), the memory probe (1,024 / 2,048 / 4,096), then timed 8,192
  probe8k      load at 8,192, the memory probe, then timed 8,192
  calib-reset  as calib, torch._dynamo.reset() before the timed steps
Each times the alpaca profile 15 s, then samples of 60-110 tokens (the nights' records) 15 s."""
import json, random, sys, time
from pathlib import Path
variant, out = sys.argv[1], Path(sys.argv[2])
cache = Path(f"/tmp/hint-cache-{variant}-{int(time.time())}")
from jobs.training.unsloth_backend import setup_caches
setup_caches(cache)
from jobs.training.unsloth_import import import_unsloth
t0 = time.perf_counter(); skipped = import_unsloth(); t_imp = time.perf_counter() - t0
import torch
from jobs.contract.calibration import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training.config import TrainConfig
from jobs.training.load import load_for_training
from jobs.training.optim import build_optimizer
from jobs.training.probe import ProbeSettings, probe_memory, timed_steps
from jobs.training.synthetic import make_samples
cfg = TrainConfig(backend="auto", batching="packed", compute="bf16", lora_rank=16, lora_alpha=16, max_seq_length=2048,
                  gradient_checkpointing=False)
load_tokens = 32768 if variant.startswith("calib") else 8192
loaded = load_for_training(Path("/tmp/models/llama3.1-8b"), cfg, adapter=None,
                           shape=StepShape(tokens_per_step=load_tokens, gradient_checkpointing=False, basis="x"),
                           cache_dir=cache, max_vram_gb=40)
vocab = len(loaded.tokenizer)
opt = build_optimizer(loaded.model, cfg, loaded.optim, device=loaded.device)
res = {"variant": variant, "import_seconds": round(t_imp, 2), "trl_rewrite_skipped": skipped}
if variant != "direct":
    t = time.perf_counter()
    p = probe_memory(loaded.model, make_samples("wiki", 8 * 2048, vocab=vocab, cap=2048),
                     ProbeSettings(max_vram_gb=40, min_tokens=2048, headroom_gb=3), opt)
    res["probe"] = {"tokens_per_step": p.tokens_per_step, "probes": p.probes, "seconds": round(time.perf_counter() - t, 1)}
if variant == "calib-reset":
    torch._dynamo.reset()
r = random.Random(5)
records = [TokenizedSample(i, ids, list(ids)) for i, ids in
           enumerate([[r.randrange(16, vocab - 16) for _ in range(r.randint(60, 110))] for _ in range(6000)])]
for name, data in (("alpaca", make_samples("alpaca", 40 * 8192, vocab=vocab, cap=2048, seed=1)), ("records85", records)):
    t = time.perf_counter()
    th = timed_steps(loaded.model, data, 8192, opt, seconds=15)
    res[name] = {"tokens_per_second": round(th.tokens_per_second, 1), "steps": th.steps, "stalls": th.stalls,
                 "wall_incl_warmup": round(time.perf_counter() - t, 1)}
    print(variant, name, res[name], flush=True)
res["peak_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
out.write_text(json.dumps(res, indent=1))
print(json.dumps(res))
