"""Random-token samples with the published benchmark's length profiles.

Throughput and memory do not depend on what the tokens say, only on how many there are and how
they are cut into samples, so calibration and the benchmark train on these: log-normal lengths
with the mean of the two published data sets ("alpaca": 117 tokens, "wiki": 861), capped.
"""

from __future__ import annotations

import math
import random

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
                 prompt_share: float = 0.0) -> list[TokenizedSample]:
    """Enough random-token samples for about `n_tokens` real tokens. `prompt_share`: that share of each
    sample's first tokens is not trained on (labels IGNORE_INDEX), as a night's prompts are not, to time
    whether a loss that skips ignored positions makes such steps faster (at least one token stays trained)."""
    rng = random.Random(seed)
    out: list[TokenizedSample] = []
    total, i = 0, 0
    lengths = sample_lengths(profile, max(64, int(3 * n_tokens / PROFILES[profile])), seed=seed, cap=cap)
    while total < n_tokens:
        n = lengths[i % len(lengths)]
        ids = [rng.randrange(16, vocab - 16) for _ in range(n)]
        masked = min(n - 1, int(n * prompt_share))
        out.append(TokenizedSample(i, ids, [IGNORE_INDEX] * masked + ids[masked:]))
        total += n
        i += 1
    return out
