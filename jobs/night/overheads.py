"""What a night spends besides training, measured by `nightshift calibrate` for the planner.

The plan's capacity is (deadline - now - overheads) x tokens/s; before this, calibrate left the
overheads to the config's prior (600 s by default). Measured here on the loaded model:
- load: the model load calibrate itself just did (with the night's loader and caches);
- evaluate: before and after, each the largest held-out set a night evaluates (`[eval]
  max_eval_samples` samples of the short profile) plus the regression set when one is configured
  (an upper bound: the night caches the adapter in service's regression result, and held-out
  sets are usually smaller);
- publish: saving the adapter, fsyncing and hashing its files, as the registry does.
A night's own measurement (load + evaluate + publish phases) replaces these from then on.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from jobs.night.config import NightConfig
from jobs.store.files import fsync_tree, sha256_file
from jobs.training.load import Loaded


def measure_overheads(loaded: Loaded, cfg: NightConfig, *, load_seconds: float, vocab: int,
                      cap: int = 2048) -> dict[str, float]:
    """{"load", "evaluate", "publish", "total"} seconds, measured on the loaded model."""
    from jobs.learning import evaluate
    from jobs.training.models.synthetic import make_samples

    heldout = make_samples("alpaca", int(cfg.eval.max_eval_samples * 117), vocab=vocab, cap=cap, seed=7)
    heldout = heldout[: cfg.eval.max_eval_samples]
    sets = [heldout]
    if cfg.eval.canary_set is not None and Path(cfg.eval.canary_set).is_file():
        sets.append(evaluate.load_regression_set(cfg.eval.canary_set, loaded.tokenizer,
                                                 limit=cfg.eval.max_eval_samples,
                                                 max_seq_length=cfg.train.max_seq_length))
    kw = {"pad_id": loaded.tokenizer.pad_token_id or 0, "device": loaded.device,
          "max_tokens_per_batch": cfg.eval.max_tokens_per_batch}
    t0 = time.perf_counter()
    for samples in sets:
        evaluate.eval_metrics(loaded.model, samples, **kw)
    evaluate_seconds = 2 * (time.perf_counter() - t0)  # before and after
    loaded.model.train()
    with tempfile.TemporaryDirectory(dir=Path(cfg.state_dir), prefix=".calibrate-save-") as tmp:
        t1 = time.perf_counter()
        loaded.model.save_pretrained(tmp)
        fsync_tree(Path(tmp))
        for f in Path(tmp).rglob("*"):
            if f.is_file():
                sha256_file(f)
        publish_seconds = time.perf_counter() - t1
    out = {"load": load_seconds, "evaluate": evaluate_seconds, "publish": publish_seconds}
    return {k: round(v, 2) for k, v in {**out, "total": sum(out.values())}.items()}
