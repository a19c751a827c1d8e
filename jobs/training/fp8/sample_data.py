"""Real sample tokens for measurements on the GPU: the operator's data where the tokenizer covers it.

The FP8 check captures the projections' activations over them (calibrate: the regression set and the
sources' inboxes first), and `python -m benchmarks bench --token-file` cuts its samples from a file's tokens (an
8B's steps ran as fast on uniform random ids as on a night's records: H200, 2026-11-26). Random ids
are the fallback where no sample data fits (a random-initialised model's word-level tokenizer).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("nightshift.train")
RANDOM = "random token ids (no sample data the tokenizer covers)"  # where sample_tokens' fallback came from


def data_files(regression_set: Path | None, inboxes: list[Path]) -> list[Path]:
    """Where calibrate finds real samples: the regression set, the sources' inboxes, the shipped samples."""
    files = [regression_set] if regression_set else []
    for d in inboxes:
        files += sorted(p for pat in ("*.jsonl", "*.json") for p in Path(d).glob(pat))[:2]
    shipped = Path(__file__).resolve().parents[3] / "config" / "sample-inbox"
    files += sorted(shipped.glob("*.jsonl"))
    return [f for f in files if f is not None and Path(f).is_file()]


def sample_tokens(tokenizer: Any, files: list[Path], *, n: int) -> tuple[list[int], str]:
    """Up to `n` tokens of real samples, concatenated, and where they came from; `n` random token ids
    when there is no data or the tokenizer does not cover it (a random-initialised bench model)."""
    from jobs.learning.evaluate import load_regression_set
    from jobs.training.fp8.numerics import activation_tokens

    for f in files:
        try:
            samples = load_regression_set(f, tokenizer, max_seq_length=4096, limit=max(256, n // 16))
        except Exception as e:
            log.info("sample_file_skipped", file=str(f), error=str(e)[:200])
            continue
        ids = activation_tokens(samples, n)
        unk = getattr(tokenizer, "unk_token_id", None)
        if len(ids) >= 64 and (unk is None or sum(i == unk for i in ids) < len(ids) / 2):
            return ids, f"{len(ids)} tokens of {f.name}"
    vocab = len(tokenizer)
    rng = random.Random(0)
    return [rng.randrange(16, vocab - 16) for _ in range(n)], RANDOM
