# ruff: noqa  (the device script as it ran: cache locations and imports are set up before the imports that read them)
"""Where the first training step's ~4.5 s go, and whether a warm-up step of another length (as a thread
beside other work would run it) takes them off the first real step. A fresh process, the night's caches."""
import json
import random
import sys
import threading
import time
from pathlib import Path

from jobs.training.unsloth_backend import setup_caches

setup_caches(Path(sys.argv[2]))
from jobs.training.unsloth_import import import_unsloth  # noqa: E402

import_unsloth()
import torch  # noqa: E402

from jobs.contract import StepShape  # noqa: E402
from jobs.data.batching import TokenizedSample  # noqa: E402
from jobs.training.config import TrainConfig  # noqa: E402
from jobs.training.load import load_for_training  # noqa: E402
from jobs.training.packing import pack  # noqa: E402
from jobs.training.step import model_inputs  # noqa: E402

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
mode = sys.argv[3]


def load():
    return load_for_training(Path(sys.argv[1]), cfg, adapter=None,
                             shape=StepShape(tokens_per_step=8192, gradient_checkpointing=False, basis="x"),
                             cache_dir=Path(sys.argv[2]))


if mode == "loadthread":  # loaded (patched, compile regions set up) in a thread, trained in the main thread
    got = {}
    th = threading.Thread(target=lambda: got.update(loaded=load()))
    th.start()
    th.join()
    loaded = got["loaded"]
else:
    loaded = load()
m = loaded.model
m.train()
res = {"load_s": round(time.time() - t, 2)}


def step(b):
    t = time.time()
    out = m(**model_inputs(b, "cuda", unsloth=True))
    out.loss.backward()
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return round(time.time() - t, 3)


b1, b2, b3 = batch(8150), batch(8050), batch(7990)
if mode == "thread":  # the warm-up in a thread, as beside the pull; then the real steps in the main thread
    box = {}
    th = threading.Thread(target=lambda: box.update(warm=step(b1)))
    t = time.time()
    th.start()
    th.join()
    res["warm_in_thread_s"] = box["warm"]
res.update(first=step(b2), second=step(b3), third=step(b1), lengths=[b1.real_tokens, b2.real_tokens, b3.real_tokens])
print(json.dumps({mode: res}), flush=True)
