# ruff: noqa  (the device script as it ran: cache locations are set before the imports that read them)
"""Does the base quantised in this process (calibrate, a first night) differ from the NF4 copy the nights load
from the cache: its 4-bit layout, its first step (compile caches), its speed? argv: model, cache dir, label."""
import json
import random
import sys
import time
from pathlib import Path

from jobs.training.unsloth_backend import setup_caches

setup_caches(Path(sys.argv[2]))
from jobs.training.unsloth_import import import_unsloth

import_unsloth()
import torch

from jobs.contract import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training.config import TrainConfig
from jobs.training.load import load_for_training
from jobs.training.optim import build_optimizer
from jobs.training.packing import pack
from jobs.training.step import train_step

r = random.Random(0)


def batch(total):
    out, used, i = [], 0, 0
    while used < total - 120:
        n = r.randint(60, 110)
        ids = [r.randrange(3, 256) for _ in range(n)]
        out.append(TokenizedSample(i, ids, ids))
        used, i = used + n, i + 1
    return pack(out)


cfg = TrainConfig(backend="unsloth", lora_rank=16, lora_alpha=16, max_seq_length=2048, gradient_checkpointing=False)
t = time.time()
loaded = load_for_training(Path(sys.argv[1]), cfg, adapter=None,
                           shape=StepShape(tokens_per_step=8192, gradient_checkpointing=False, basis="x"),
                           cache_dir=Path(sys.argv[2]))
res = {"label": sys.argv[3], "load_s": round(time.time() - t, 2), "from": loaded.info.get("base_loaded_from"),
       "hit": loaded.info.get("base_cache_hit")}
try:
    layer = next(m for n, m in loaded.model.named_modules() if n.endswith("layers.0.mlp.gate_proj"))
    w = getattr(layer, "base_layer", layer).weight
    qs = getattr(w, "quant_state", None)
    res["layout"] = {"weight": [str(w.dtype), list(w.shape)], "quant_type": getattr(qs, "quant_type", None),
                     "blocksize": getattr(qs, "blocksize", None), "nested": getattr(qs, "nested", None),
                     "dtype": str(getattr(qs, "dtype", None)),
                     "absmax": str(getattr(getattr(qs, "absmax", None), "dtype", None))}
except Exception as e:
    res["layout"] = f"{type(e).__name__}: {e}"
opt = build_optimizer(loaded.model, cfg, loaded.optim, device="cuda")
loaded.model.train()
bs = [batch(8150) for _ in range(24)]
t = time.time()
st = train_step(loaded.model, bs[0], opt)
res["first_step_s"] = round(time.time() - t, 2)
for b in bs[1:4]:
    train_step(loaded.model, b, opt)
tok, secs = 0, 0.0
for b in bs[4:]:
    s = train_step(loaded.model, b, opt)
    tok, secs = tok + s.tokens, secs + s.seconds
res["tok_s_20_steps"] = round(tok / secs)
print(json.dumps(res), flush=True)
