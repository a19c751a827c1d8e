"""Samples with the published benchmark's length profiles: log-normal lengths with the mean of the
two published data sets ("alpaca": 117 tokens, "wiki": 861), capped.

What the tokens say changed neither speed nor memory where it was measured: on one H200 an 8B's packed
steps ran at 15,505 tok/s cut from a night's records and 15,596 / 15,720 on uniform random ids (bench
runs either side, the same 36.3 GB peak; RESULTS.md: 2026-11-26, token content). So the ids are random,
or cut from a `pool` of real sample tokens (`python -m benchmarks --token-file`, to check that elsewhere).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from jobs.data.batching import IGNORE_INDEX, TokenizedSample

PROFILES = {"alpaca": 117.0, "wiki": 861.0}  # mean tokens per sample
CAP = 2048


def sample_lengths(profile: str, n: int, *, seed: int = 0, sigma: float = 0.8, cap: int = CAP) -> list[int]:
    """Log-normal lengths (at least 8 tokens, at most `cap`) whose mean after the cap is the profile's."""
    mean = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")
    z = [rng.gauss(0.0, 1.0) for _ in range(n)]

    def draw(mu: float) -> list[int]:
        return [max(8, min(cap, round(math.exp(mu + sigma * x)))) for x in z]

    lo, hi = math.log(mean) - 3.0, math.log(mean) + 3.0
    for _ in range(40):  # the capped mean grows with mu: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(draw(mid)) / n < mean else (lo, mid)
    return draw((lo + hi) / 2)


def make_samples(profile: str, n_tokens: int, *, vocab: int, seed: int = 0, cap: int = CAP,
                 prompt_share: float = 0.0, pool: Sequence[int] | None = None) -> list[TokenizedSample]:
    """Enough samples for about `n_tokens` real tokens: random ids, or each a run of `pool` from a random
    offset (wrapping). `prompt_share`: that share of each sample's first tokens is not trained on (labels
    IGNORE_INDEX), as a night's prompts are not (at least one token stays trained)."""
    rng = random.Random(seed)
    if pool is not None and not pool:
        raise ValueError("an empty pool of sample tokens")
    out: list[TokenizedSample] = []
    total, i = 0, 0
    lengths = sample_lengths(profile, max(64, int(3 * n_tokens / PROFILES[profile])), seed=seed, cap=cap)
    while total < n_tokens:
        n = lengths[i % len(lengths)]
        if pool is None:
            ids = [rng.randrange(16, vocab - 16) for _ in range(n)]
        else:
            at = rng.randrange(len(pool))
            ids = [pool[(at + j) % len(pool)] for j in range(n)]
        masked = min(n - 1, int(n * prompt_share))
        out.append(TokenizedSample(i, ids, [IGNORE_INDEX] * masked + ids[masked:]))
        total += n
        i += 1
    return out
