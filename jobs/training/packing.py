"""Packed (padding-free) batches cut to a token budget, and the budget chosen from measured memory.

Why: with short samples a padded batch of N samples wastes the GPU on padding and on tiny
steps. Packing concatenates samples into one row of about `tokens_per_step` tokens, with
`position_ids` restarting at 0 for every sample. Attention backends then keep samples apart:
transformers 5 turns reset position ids (with `attention_mask=None`) into a block-diagonal
causal mask, and Unsloth turns them into varlen (cu_seqlens) attention. The label of each
sample's first token is IGNORE_INDEX, so no token is predicted from the previous sample.

The token budget per step is the knob that trades speed for memory: activation memory grows
about linearly with tokens per step, so one or two probe steps give a line, and the budget is
the largest multiple of `multiple` tokens whose predicted peak stays under `[gpu] max_vram_gb`.
Everything here is pure Python (no torch), so it is tested on the CPU.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jobs.contract import MemoryModel
from jobs.data.batching import IGNORE_INDEX, Batch, TokenizedSample

GB = 1e9  # decimal gigabytes, as `[gpu] max_vram_gb` and nvidia-smi's "GB" readings


LOOKAHEAD = 256  # how many older samples may still wait when one is packed


def packed_batches(samples: Sequence[TokenizedSample], *, tokens_per_step: int,
                   lookahead: int = LOOKAHEAD) -> Iterator[Batch]:
    """Rows of at most `tokens_per_step` real tokens, each one batch, every sample exactly once.

    Each row opens with the oldest sample not packed yet and is filled best-fit from the window of the
    next `lookahead` samples not packed yet (the largest that still fits, the oldest of equal ones;
    each one taken lets the next sample into the window) until none fits. Why not next-fit in order
    (`lookahead=0`): with long samples a row closes on the first that does not fit, and its GEMMs run
    short (Qwen3-32B, 861-token samples, a 2,560-token budget: rows 69 % full). No sample is packed
    while more than `lookahead` older ones wait, so a deadline's cut (the last rows) defers at most
    `lookahead` samples older than any it keeps; the rows are a function of the samples alone, so a
    resumed run replays exactly the same batches. A sample longer than the budget gets a row of its own
    (callers cap samples at max_seq_length, and the budget is never chosen below it).
    """
    if tokens_per_step < 1:
        raise ValueError("tokens_per_step must be >= 1")
    if lookahead < 0:
        raise ValueError("lookahead must be >= 0")
    todo = enumerate(s for s in samples if s.n_tokens > 0)
    window: dict[int, TokenizedSample] = {}  # position -> sample, not packed yet, oldest first
    by_size: list[tuple[int, int]] = []  # (tokens, position) of the window's samples, sorted

    def refill() -> None:
        for pos, s in itertools.islice(todo, max(0, lookahead + 1 - len(window))):
            window[pos] = s
            bisect.insort(by_size, (s.n_tokens, pos))

    refill()
    while window:
        first = next(iter(window))
        row = {first: window.pop(first)}
        by_size.remove((row[first].n_tokens, first))
        room = tokens_per_step - row[first].n_tokens
        refill()
        while by_size and room >= by_size[0][0]:
            largest = by_size[bisect.bisect_right(by_size, (room, 1 << 62)) - 1][0]
            _, pos = by_size.pop(bisect.bisect_left(by_size, (largest, -1)))  # the oldest of that size
            row[pos] = window.pop(pos)
            room -= largest
            refill()
        yield pack([row[pos] for pos in sorted(row)])


def pack(group: Sequence[TokenizedSample]) -> Batch:
    """Concatenate samples into one row; positions restart per sample, first labels masked."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for s in group:
        ids.extend(s.input_ids)
        labels.append(IGNORE_INDEX)  # never predict a sample's first token from the previous sample
        labels.extend(s.labels[1:])
        pos.extend(range(s.n_tokens))
    return Batch(
        input_ids=[ids],
        labels=[labels],
        attention_mask=None,
        position_ids=[pos],
        sample_ids=[s.sample_id for s in group],
        real_tokens=len(ids),
    )


def segment_lengths(position_ids: Sequence[int]) -> list[int]:
    """Sample lengths of one packed row, read back from where the positions restart at 0."""
    lengths: list[int] = []
    for p in position_ids:
        if p == 0 or not lengths:
            lengths.append(1)
        else:
            lengths[-1] += 1
    return lengths


def is_packed(batch: Batch) -> bool:
    return batch.attention_mask is None and batch.position_ids is not None and len(batch.input_ids) == 1


def unpack(batch: Batch) -> list[TokenizedSample]:
    """The samples of a packed batch, back (first labels stay IGNORE_INDEX: they are never used)."""
    if not is_packed(batch):
        raise ValueError("not a packed batch")
    out: list[TokenizedSample] = []
    start = 0
    lengths = segment_lengths(batch.position_ids[0])  # type: ignore[index]
    for sid, n in zip(batch.sample_ids, lengths, strict=True):
        out.append(TokenizedSample(sid, batch.input_ids[0][start : start + n], batch.labels[0][start : start + n]))
        start += n
    return out


def split_in_two(batch: Batch) -> list[Batch]:
    """Halve a packed batch (same samples, same order): the retry after a CUDA out-of-memory."""
    group = unpack(batch)
    if len(group) < 2:
        return [batch]
    half = max(1, batch.real_tokens // 2)
    first: list[TokenizedSample] = []
    used = 0
    for s in group:
        if first and used + s.n_tokens > half:
            break
        first.append(s)
        used += s.n_tokens
    rest = group[len(first) :]
    return [pack(first), pack(rest)] if rest else [pack(first)]


# ---- the token budget per step, from measured memory ----------------------------------------------


@dataclass(frozen=True)
class MemoryProbe:
    """One measured step: its real tokens and the process's peak GPU memory (bytes) during it."""

    tokens: int
    peak_bytes: float


def memory_model(static_bytes: float, bytes_per_token: float) -> MemoryModel:
    return MemoryModel(static_gb=max(0.0, static_bytes) / GB, mb_per_token=max(1.0, bytes_per_token) / 1e6)


def fit_memory(probes: Sequence[MemoryProbe], *, static_bytes: float | None = None) -> MemoryModel:
    """A line through the probes: two or more give slope and intercept; one needs `static_bytes`
    (the memory held before the step: weights, optimizer state, CUDA context)."""
    if not probes:
        raise ValueError("need at least one probe")
    if len({p.tokens for p in probes}) >= 2:
        n = len(probes)
        mx = sum(p.tokens for p in probes) / n
        my = sum(p.peak_bytes for p in probes) / n
        sxx = sum((p.tokens - mx) ** 2 for p in probes)
        slope = sum((p.tokens - mx) * (p.peak_bytes - my) for p in probes) / sxx
        slope = max(slope, 1.0)
        return memory_model(my - slope * mx, slope)
    if static_bytes is None:
        raise ValueError("one probe size needs static_bytes")
    p = max(probes, key=lambda q: q.peak_bytes)
    return memory_model(static_bytes, (p.peak_bytes - static_bytes) / p.tokens)


def conservative_memory_model(probes: Sequence[MemoryProbe], *, static_bytes: float, at_tokens: int) -> MemoryModel:
    """Of the line through the probes and the line through (0, static) and the largest probe, the one
    that predicts more memory at `at_tokens`. Two probes of similar size give a noisy slope (seen on a
    32B: probes at 1,144 and 1,429 tokens predicted 67 GB for a step that took 83 GB); the line from
    the static memory never underestimates the slope, since activations only add to it."""
    biggest = max(probes, key=lambda p: p.tokens)
    one = fit_memory([biggest], static_bytes=static_bytes)
    if len({p.tokens for p in probes}) < 2:
        return one
    two = fit_memory(probes)
    return max((one, two), key=lambda m: m.peak_gb(max(at_tokens, biggest.tokens)))


def with_allocated_growth(reserved: MemoryModel, allocated: MemoryModel) -> MemoryModel:
    """The reserved-memory line (what the card sees, what the cap is about), its slope at least the allocated
    line's. Free space inside segments the allocator already holds absorbs a small probe's activations and hides
    their growth from the reserved peak: a calibrate of the 8B (FP8, a q,v adapter, H200) held 24.6 GB reserved
    after its warm-up, no probe peaked higher, the slope read 1e-6 MB a token and the budget went to 32,768 tokens
    under a 40 GB cap. Allocated memory never hides growth."""
    if allocated.mb_per_token <= reserved.mb_per_token:
        return reserved
    return MemoryModel(static_gb=reserved.static_gb, mb_per_token=allocated.mb_per_token)


def second_probe_tokens(
    first: MemoryProbe,
    *,
    static_bytes: float,
    max_vram_gb: float,
    want: int,
    headroom_gb: float = 3.0,
    margin: float = 0.8,
) -> int:
    """Size of the second probe step: `want`, or less where the line through (0, static) and the first
    probe says `want` would not fit (a probe must not break the limit it is there to respect)."""
    est = fit_memory([first], static_bytes=static_bytes)
    return max(1, min(want, int(margin * est.tokens_fitting(max_vram_gb - headroom_gb))))


def choose_token_budget(
    model: MemoryModel,
    *,
    max_vram_gb: float,
    min_tokens: int,
    max_tokens: int,
    headroom_gb: float = 2.0,
    multiple: int = 256,
) -> int | None:
    """Largest budget (a multiple of `multiple`, within [min_tokens, max_tokens]) whose predicted
    peak stays `headroom_gb` under `max_vram_gb`; None when not even `min_tokens` fits.

    `min_tokens` is normally max_seq_length: a step must hold the longest sample. The headroom
    covers the CUDA context (~0.5 GB, not seen by torch's counters) and allocator slack.
    """
    fit = min(model.tokens_fitting(max_vram_gb - headroom_gb), max_tokens)
    budget = (fit // multiple) * multiple
    if budget < min_tokens:
        return min_tokens if fit >= min_tokens else None
    return budget
