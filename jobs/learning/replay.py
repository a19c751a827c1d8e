"""Replay that protects every earlier night: a stratified choice of already-trained samples.

The pool is cut into strata, one per (version that trained it, source): one per earlier night
and source. The strata are served round-robin, one sample of each in turn, so every earlier night
gets the same number of replayed samples whatever its size (a uniform draw gave the first task's
share of the replay 100 % -> 56 % as later data piled up), and each stratum gets at least
`min_per_stratum` samples where the night's capacity allows.

Deterministic for a given night: the order inside a stratum and the order of the strata come from
a hash of (seed, sample hash) with the night as the seed, never the random run id; so two runs of
the same chain replay the same samples, a rerun of a night replays what its first attempt planned,
and a sample's rank does not change as the pool grows. Successive nights (other seeds) replay
other samples and start the round-robin at other strata.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from jobs.store.ledger import SampleRow


def rank(seed: str, key: str) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def strata(pool: Sequence[SampleRow], seed: str) -> list[list[SampleRow]]:
    """The pool's strata in the night's order, each in the night's order."""
    groups: dict[str, list[SampleRow]] = {}
    for s in pool:
        groups.setdefault(f"v{s.version or 0}/{s.source}", []).append(s)
    return [sorted(groups[k], key=lambda s: rank(seed, s.hash)) for k in sorted(groups, key=lambda k: rank(seed, k))]


def choose_replay(pool: Sequence[SampleRow], budget_tokens: float, seed: str, *, min_per_stratum: int = 0,
                  quota_cap: float = 0.0) -> list[SampleRow]:
    """Samples of the pool within the budget, round-robin over the strata. To give every stratum
    `min_per_stratum` samples the budget may be raised, up to `quota_cap` tokens."""
    groups = strata(pool, seed)
    if min_per_stratum:
        quota = sum(s.n_tokens for g in groups for s in g[:min_per_stratum])
        budget_tokens = max(budget_tokens, min(quota, quota_cap))
    out: list[SampleRow] = []
    tokens, depth = 0, 0
    while budget_tokens - tokens >= 1 and any(depth < len(g) for g in groups):
        for g in groups:
            if depth < len(g) and tokens + g[depth].n_tokens <= budget_tokens:
                out.append(g[depth])
                tokens += g[depth].n_tokens
        depth += 1
    return sorted(out, key=lambda s: s.id)
