# ruff: noqa  (the device script as it ran: cache locations and imports are set up before the imports that read them)
"""Does a new LoRA (every lora_B zero) score exactly as the base under Unsloth's kernels on the GPU?
(measure.py takes the base's figures for a first night's `before`; CPU-tested on PEFT only.)"""
import json
import random
import sys
import time
from pathlib import Path

from jobs.training.unsloth_import import import_unsloth

import_unsloth()
import torch  # noqa: E402

from jobs.contract import StepShape  # noqa: E402
from jobs.data.batching import TokenizedSample  # noqa: E402
from jobs.evaluate import score_samples  # noqa: E402
from jobs.night.measure import _new_adapter  # noqa: E402
from jobs.training.config import TrainConfig  # noqa: E402
from jobs.training.load import load_for_training  # noqa: E402

out = {}
r = random.Random(0)
samples = []
for i in range(256):
    n = r.randint(60, 110)
    ids = [r.randrange(3, 256) for _ in range(n)]
    samples.append(TokenizedSample(i, ids, [-100] * (n // 2) + ids[n // 2:]))
for compute in sys.argv[2:]:
    cfg = TrainConfig(backend="unsloth", lora_rank=16, lora_alpha=16, max_seq_length=2048,
                      gradient_checkpointing=False)
    shape = StepShape(tokens_per_step=8192, gradient_checkpointing=False, basis="check", compute=compute)
    t = time.time()
    loaded = load_for_training(Path(sys.argv[1]), cfg, adapter=None, shape=shape, cache_dir=Path("/tmp/nk-models"))
    m = loaded.model
    kw = {"pad_id": loaded.tokenizer.pad_token_id or 0, "device": "cuda", "max_tokens_per_batch": 8192}
    new = _new_adapter(m)
    with m.disable_adapter():
        base = score_samples(m, samples, **kw)
    with_adapter = score_samples(m, samples, **kw)
    same = sum(base[k] == with_adapter[k] for k in base)
    rel = max(abs(base[k].loss_sum - with_adapter[k].loss_sum) / max(1e-9, abs(base[k].loss_sum)) for k in base)
    out[compute] = {"new_adapter": new, "samples": len(base), "identical": same, "max_rel_loss_diff": rel,
                    "load_s": round(time.time() - t, 1), "fp8": loaded.info.get("fp8", {}).get("compute")}
    print(json.dumps(out[compute]), flush=True)
    del m, loaded
    torch.cuda.empty_cache()
print(json.dumps(out))
