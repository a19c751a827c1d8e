"""The batch sequence of a run: deterministic from (samples, seed, step shape, probe sizes, cuts), so a
resume rebuilds exactly the sequence its checkpoint counted in; and which samples a cut defers.

A cut keeps the batches before it and packs the rest of the first epoch again without the cut samples;
later epochs leave them out. The loop applies a cut to the sequence it has (one repacking); only a
resume replays every cut from the start.
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.data.batching import Batch, TokenizedSample, padded_batches
from jobs.training.config import TrainConfig

PROBE_TOKENS = 256
Cut = tuple[int, list[int]]  # (batch index the cut was made at, sample ids cut)


def plan_batches(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int, tokens_per_step: int,
                 probe_samples: Sequence[int] = (), cuts: Sequence[Cut] = ()) -> list[Batch]:
    """The whole run's batch sequence, deterministic from (samples, seed, step shape, probe sizes, cuts):
    a resume replays it. `probe_samples`: the first epoch opens with one batch of each of these many samples."""
    return sequence(samples, cfg, pad_id, tokens_per_step, probe_samples, cuts)[0]


def sequence(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int, tokens_per_step: int,
             probe_samples: Sequence[int], cuts: Sequence[Cut]) -> tuple[list[Batch], int]:
    """(batches, how many of them are the first epoch's). Each cut keeps the batches before it and
    packs the rest of the first epoch again without the cut samples; later epochs leave them out."""
    first: list[Batch] = []
    start = 0
    for k in probe_samples:  # first epoch in plan order (oldest first); later epochs shuffled
        if samples[start : start + k]:
            first.extend(_batches(samples[start : start + k], cfg, pad_id, 1 << 30))
        start += k
    first.extend(_batches(samples[start:], cfg, pad_id, tokens_per_step))
    gone: set[int] = set()
    for at, ids in cuts:
        first = cut_first(samples, first, at, ids, gone, cfg, pad_id, tokens_per_step)
    return first + later_epochs(samples, gone, cfg, pad_id, tokens_per_step), len(first)


def cut_first(samples: Sequence[TokenizedSample], first: list[Batch], at: int, ids: Sequence[int], gone: set[int],
              cfg: TrainConfig, pad_id: int, tokens_per_step: int) -> list[Batch]:
    """The first epoch after one cut at batch `at` (`gone`, the ids cut so far, gains `ids`): the batches
    before `at` kept, the samples not reached packed again without the cut ones."""
    gone |= set(ids)
    skip = gone | {sid for b in first[:at] for sid in b.sample_ids}
    return first[:at] + _batches([s for s in samples if s.sample_id not in skip], cfg, pad_id, tokens_per_step)


def later_epochs(samples: Sequence[TokenizedSample], gone: set[int], cfg: TrainConfig, pad_id: int,
                 tokens_per_step: int) -> list[Batch]:
    """Epochs 2.. over the samples not cut, each in its own seeded order (the same on a resume)."""
    import random

    kept = [s for s in samples if s.sample_id not in gone]
    out: list[Batch] = []
    for epoch in range(1, cfg.epochs):
        order = list(kept)
        random.Random(cfg.seed + epoch).shuffle(order)
        out.extend(_batches(order, cfg, pad_id, tokens_per_step))
    return out


def _batches(order: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int, tokens: int) -> list[Batch]:
    from jobs.training.packing import packed_batches

    if cfg.batching == "packed":
        return list(packed_batches(order, tokens_per_step=tokens))
    big = tokens >= 1 << 30  # a probe batch: all its samples in one step
    return list(padded_batches(order, batch_size=len(order) if big else cfg.batch_size,
                               max_tokens_per_batch=tokens if big else min(tokens, cfg.max_tokens_per_batch),
                               pad_id=pad_id))


def probe_sizes(samples: Sequence[TokenizedSample], tokens: int = PROBE_TOKENS, world: int = 1) -> list[int]:
    """How many samples each probe batch takes: two probe steps of about `tokens` each (at least one
    sample a rank). [distributed] `world` ranks: each probe step is split into `world` rows (one per
    rank), so the global probe step holds what one process's would."""
    sizes: list[int] = []
    i = 0
    for _ in range(2):
        n = used = 0
        while i + n < len(samples) and (n < world or used + samples[i + n].n_tokens <= tokens):
            used += samples[i + n].n_tokens
            n += 1
        sizes += [n // world + (1 if r < n % world else 0) for r in range(min(n, world))]
        i += n
    return sizes


def samples_to_cut(batches: Sequence[Batch], i: int, first_len: int, *, rate: float, left: float,
                   epochs: int) -> list[int]:
    """Rank 0's decision before step i: the samples to cut when the rest of the run, at `rate` tokens/s
    (measured this attempt, after the probes), would not fit in the `left` seconds."""
    over = (sum(b.real_tokens for b in batches[i:]) / rate - left) * rate * 1.1
    return _to_cut(batches, i, first_len, over, epochs) if over > 0 else []


def _to_cut(batches: Sequence[Batch], i: int, first_len: int, tokens_over: float, epochs: int) -> list[int]:
    """Samples of the first epoch not reached yet (batches i..), from the tail, whose tokens over all
    epochs cover `tokens_over`."""
    seen = {sid for b in batches[:i] for sid in b.sample_ids}
    tail: list[tuple[int, int]] = []  # (sample id, real tokens)
    for b in batches[i:first_len]:
        lengths = _lengths(b)
        tail += [(sid, n) for sid, n in zip(b.sample_ids, lengths, strict=True) if sid not in seen]
    out, removed = [], 0.0
    for sid, n in reversed(tail):
        if removed >= tokens_over:
            break
        out.append(sid)
        removed += n * epochs
    return out


def _lengths(b: Batch) -> list[int]:
    if b.attention_mask is not None:  # padded: one sample per row
        return [sum(row) for row in b.attention_mask]
    return [b.real_tokens // max(1, len(b.sample_ids))] * len(b.sample_ids)  # packed: an even share is enough
