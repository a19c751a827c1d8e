"""Packing keeps samples apart: a packed batch trains exactly like its samples one by one."""

from __future__ import annotations

import itertools
import random

import pytest

from jobs.contract import MemoryModel
from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.training.packing import (
    GB,
    MemoryProbe,
    choose_token_budget,
    conservative_memory_model,
    fit_memory,
    is_packed,
    memory_model,
    pack,
    packed_batches,
    second_probe_tokens,
    segment_lengths,
    split_in_two,
    unpack,
)
from jobs.training.step import model_inputs


def peak(m: MemoryModel, tokens: int) -> float:
    return m.peak_gb(tokens) * GB

def _samples(n: int, *, seed: int = 0, lo: int = 2, hi: int = 40, vocab: int = 200) -> list[TokenizedSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
        labels = list(ids)
        if len(ids) > 4 and i % 2:  # some prompt tokens not trained on
            labels[:3] = [IGNORE_INDEX] * 3
        out.append(TokenizedSample(i, ids, labels))
    return out


# ---- batching by budget (pure) -------------------------------------------------------------------


def test_packed_batches_respect_budget_and_cover_everything_once():
    samples = _samples(200, seed=1)
    batches = list(packed_batches(samples, tokens_per_step=128))
    assert sorted(sid for b in batches for sid in b.sample_ids) == [s.sample_id for s in samples]
    for b in batches:
        assert is_packed(b)
        assert b.real_tokens == sum(len(r) for r in b.input_ids) == len(b.input_ids[0]) <= 128
        assert len(b.labels[0]) == len(b.position_ids[0]) == b.real_tokens
        assert b.sample_ids == sorted(b.sample_ids)  # in their own order within a row
    assert batches == list(packed_batches(samples, tokens_per_step=128))  # a resume replays the same rows


def test_without_lookahead_packing_is_next_fit_in_order():
    samples = _samples(200, seed=1)
    batches = list(packed_batches(samples, tokens_per_step=128, lookahead=0))
    assert [sid for b in batches for sid in b.sample_ids] == [s.sample_id for s in samples]
    for b, nxt in itertools.pairwise(batches):  # each row but the last could not take the next sample
        assert b.real_tokens + samples[nxt.sample_ids[0]].n_tokens > 128


@pytest.mark.parametrize("lookahead", [1, 7, 256])
def test_best_fit_fills_rows_and_no_sample_jumps_more_than_the_lookahead(lookahead):
    """Long samples against a small budget (a 32B's step on 861-token data): next-fit leaves rows part
    empty; filling from the window leaves them nearly full, and a sample is never packed while more
    than `lookahead` older ones wait."""
    samples = _samples(3000, seed=4, lo=20, hi=900)
    budget = 2048
    fill = {la: sum(b.real_tokens for b in bs) / (len(bs) * budget)
            for la in (0, lookahead) for bs in [list(packed_batches(samples, tokens_per_step=budget, lookahead=la))]}
    assert fill[lookahead] > fill[0]
    if lookahead == 256:
        assert fill[0] < 0.85 and fill[256] > 0.98
    packed: set[int] = set()
    for b in packed_batches(samples, tokens_per_step=budget, lookahead=lookahead):
        for sid in b.sample_ids:  # older samples left for later rows waited while this one was packed
            waiting = sum(1 for older in range(sid) if older not in packed and older not in b.sample_ids)
            assert waiting <= lookahead, (sid, waiting)
        packed |= set(b.sample_ids)
        oldest_waiting = min(set(range(len(samples))) - (packed - set(b.sample_ids)))
        assert min(b.sample_ids) == oldest_waiting  # each row opens with the oldest sample not packed yet
    assert packed == set(range(len(samples)))


def test_packing_skips_empty_samples_and_refuses_bad_arguments():
    samples = [TokenizedSample(0, [], []), TokenizedSample(1, [5] * 4, [5] * 4)]
    assert [b.sample_ids for b in packed_batches(samples, tokens_per_step=8)] == [[1]]
    assert list(packed_batches([], tokens_per_step=8)) == []
    for kw in ({"tokens_per_step": 0}, {"tokens_per_step": 8, "lookahead": -1}):
        with pytest.raises(ValueError):
            list(packed_batches(samples, **kw))


def test_pack_resets_positions_and_masks_first_labels():
    samples = _samples(5, seed=2)
    b = pack(samples)
    assert segment_lengths(b.position_ids[0]) == [s.n_tokens for s in samples]
    start = 0
    for s in samples:
        seg = slice(start, start + s.n_tokens)
        assert b.position_ids[0][seg] == list(range(s.n_tokens))
        assert b.input_ids[0][seg] == s.input_ids
        assert b.labels[0][start] == IGNORE_INDEX
        assert b.labels[0][start + 1 : start + s.n_tokens] == s.labels[1:]
        start += s.n_tokens


def test_oversized_sample_gets_its_own_batch():
    samples = [
        TokenizedSample(0, [5] * 10, [5] * 10),
        TokenizedSample(1, [6] * 300, [6] * 300),
        TokenizedSample(2, [7] * 10, [7] * 10),
    ]
    batches = list(packed_batches(samples, tokens_per_step=100))
    assert [b.sample_ids for b in batches] == [[0, 2], [1]]  # 2 fills 0's row; 1 stands alone


def test_split_in_two_keeps_samples_and_order():
    samples = _samples(30, seed=3)
    b = pack(samples)
    halves = split_in_two(b)
    assert len(halves) == 2
    assert halves[0].sample_ids + halves[1].sample_ids == b.sample_ids
    assert abs(halves[0].real_tokens - halves[1].real_tokens) <= max(s.n_tokens for s in samples)
    assert [(s.sample_id, s.input_ids) for s in unpack(halves[0]) + unpack(halves[1])] == [
        (s.sample_id, s.input_ids) for s in samples
    ]


def test_memory_fit_and_budget_choice():
    # peak = 6 GB + 3.5 MB/token, measured at two sizes
    truth = memory_model(6 * GB, 3.5e6)
    m = fit_memory([MemoryProbe(2048, peak(truth, 2048)), MemoryProbe(4096, peak(truth, 4096))])
    assert m.static_gb == pytest.approx(truth.static_gb)
    assert m.mb_per_token == pytest.approx(truth.mb_per_token)
    b = choose_token_budget(m, max_vram_gb=40, min_tokens=2048, max_tokens=65536, headroom_gb=2)
    assert b is not None and b % 256 == 0
    assert peak(m, b) <= 38 * GB < peak(m, b + 256)
    # one probe + static memory gives the same line
    m1 = fit_memory([MemoryProbe(4096, peak(truth, 4096))], static_bytes=6 * GB)
    assert choose_token_budget(m1, max_vram_gb=40, min_tokens=2048, max_tokens=65536, headroom_gb=2) == b
    # the cap and the floor
    assert choose_token_budget(m, max_vram_gb=400, min_tokens=2048, max_tokens=16384) == 16384
    assert choose_token_budget(m, max_vram_gb=10, min_tokens=2048, max_tokens=65536) is None


def test_second_probe_never_breaks_the_limit():
    # a 32B-like line: 21.6 GB static, 12.8 MB/token; the first probe at 2048 tokens
    truth = memory_model(21.6 * GB, 12.8e6)
    first = MemoryProbe(2048, peak(truth, 2048))
    n = second_probe_tokens(first, static_bytes=21.6 * GB, max_vram_gb=72, want=4096, headroom_gb=3)
    assert n < 4096 and peak(truth, n) <= 69 * GB
    small = memory_model(6 * GB, 4e6)  # an 8B: the wanted size fits
    assert (
        second_probe_tokens(MemoryProbe(2048, peak(small, 2048)), static_bytes=6 * GB, max_vram_gb=40, want=4096)
        == 4096
    )


def test_conservative_model_guards_against_close_probes():
    # the 32B case: true 21.6 GB + 12.8 MB/token, probes at 1,144 / 1,429 tokens read a little high/low
    truth = memory_model(21.6 * GB, 12.8e6)
    probes = [MemoryProbe(1144, peak(truth, 1144) + 1.5 * GB), MemoryProbe(1429, peak(truth, 1429))]
    naive = fit_memory(probes)
    safe = conservative_memory_model(probes, static_bytes=21.6 * GB, at_tokens=4096)
    assert peak(naive, 4864) < peak(truth, 4864)  # the noisy two-point line underestimates
    assert peak(safe, 4864) >= peak(truth, 4864)
    b = choose_token_budget(safe, max_vram_gb=72, min_tokens=2048, max_tokens=65536, headroom_gb=3)
    assert b is not None and peak(truth, b) <= 69 * GB
    # well-separated, exact probes: the two-point line (smaller slope than static->probe) may be used
    exact = [MemoryProbe(2048, peak(truth, 2048)), MemoryProbe(4096, peak(truth, 4096))]
    m = conservative_memory_model(exact, static_bytes=20 * GB, at_tokens=4096)
    assert peak(m, 4096) >= peak(truth, 4096) - 1


# ---- the tiny model: packed == one by one ---------------------------------------------------------


def _tiny_llama(attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).float()


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_grads_equal_samples_alone(attn):
    import torch

    model = _tiny_llama(attn)
    samples = _samples(6, seed=4, lo=3, hi=30)

    # alone: the token-weighted mean of per-sample losses (weight = predicted tokens)
    model.zero_grad()
    counts = [sum(1 for x in s.labels[1:] if x != IGNORE_INDEX) for s in samples]
    total = sum(counts)
    alone = 0.0
    for s, c in zip(samples, counts, strict=True):
        out = model(input_ids=torch.tensor([s.input_ids]), labels=torch.tensor([s.labels]))
        (out.loss * c / total).backward()
        alone += float(out.loss.detach()) * c / total
    g_alone = _grads(model)

    model.zero_grad()
    b = pack(samples)
    # attention_mask None + reset positions: transformers 5 builds a block-diagonal causal mask, but only
    # without a KV cache (use_cache=False; see the control test below)
    out = model(**model_inputs(b, "cpu"))
    out.loss.backward()
    g_packed = _grads(model)

    assert float(out.loss.detach()) == pytest.approx(alone, rel=1e-5)
    assert g_alone.keys() == g_packed.keys()
    for n in g_alone:
        torch.testing.assert_close(g_packed[n], g_alone[n], rtol=1e-4, atol=1e-6, msg=n)


def test_controls_leak_across_samples():
    """The controls: ordinary positions, or a KV cache (use_cache defaults to True in transformers 5,
    and then the packed-sequence mask is skipped), attend across samples: the loss differs."""
    import torch

    model = _tiny_llama("sdpa")
    samples = _samples(6, seed=4, lo=3, hi=30)
    b = pack(samples)
    ids, labels, pos = torch.tensor(b.input_ids), torch.tensor(b.labels), torch.tensor(b.position_ids)
    with torch.no_grad():
        packed = float(model(**model_inputs(b, "cpu")).loss)
        no_positions = float(model(input_ids=ids, labels=labels, use_cache=False).loss)
        with_cache = float(model(input_ids=ids, labels=labels, position_ids=pos).loss)
    assert abs(packed - no_positions) > 1e-3
    assert abs(packed - with_cache) > 1e-3


@pytest.mark.parametrize("lookahead", [0, 16, 256])
def test_a_deadline_cut_of_best_fit_rows_defers_at_most_the_lookahead_older_than_any_sample_it_keeps(lookahead):
    """A cut takes the last rows of the first epoch. Every sample it defers was still waiting when the samples
    it keeps were packed, so for each kept sample at most `lookahead` older ones are deferred (next-fit: none)."""
    from jobs.training.batch_sequence import samples_to_cut

    samples = _samples(2000, seed=5, lo=20, hi=900)
    batches = list(packed_batches(samples, tokens_per_step=2048, lookahead=lookahead))
    total = sum(b.real_tokens for b in batches)
    cut = set(samples_to_cut(batches, 0, len(batches), rate=1000.0, left=total / 1000.0 * 0.5, epochs=1))
    assert cut and sum(samples[i].n_tokens for i in cut) >= 0.5 * total
    older_cut = [sum(1 for c in cut if c < k) for k in range(len(samples)) if k not in cut]
    assert max(older_cut) <= lookahead
    if lookahead == 0:
        assert cut == set(range(min(cut), len(samples)))  # in order: exactly the newest


def test_growth_hidden_inside_reserved_segments_still_shrinks_the_budget():
    """Calibrate of the 8B (FP8, a q,v adapter, H200): 24.6 GB reserved after the warm-up, and the probes'
    activations fit in memory the allocator already held: the reserved peaks read flat and the budget went to the
    32,768-token maximum under a 40 GB cap. The allocated peaks still grow: the budget follows them."""
    from jobs.training.packing import with_allocated_growth

    truth = memory_model(10.2 * GB, 2.3e6)  # allocated: weights + activations
    flat = [MemoryProbe(2048, 24.6 * GB), MemoryProbe(4096, 24.6 * GB)]
    reserved = conservative_memory_model(flat, static_bytes=24.6 * GB, at_tokens=4096)
    assert choose_token_budget(reserved, max_vram_gb=40, min_tokens=2048, max_tokens=32768, headroom_gb=3) == 32768
    allocated = conservative_memory_model([MemoryProbe(t, peak(truth, t)) for t in (2048, 4096)],
                                          static_bytes=10.2 * GB, at_tokens=4096)
    m = with_allocated_growth(reserved, allocated)
    b = choose_token_budget(m, max_vram_gb=40, min_tokens=2048, max_tokens=32768, headroom_gb=3)
    assert b is not None and 2048 <= b < 6000 and peak(m, b) <= 37 * GB
    assert peak(m, 32768) >= 24.6 * GB + peak(truth, 32768) - peak(truth, 0)  # no hole is counted on
    normal = conservative_memory_model([MemoryProbe(t, peak(truth, t) + GB) for t in (2048, 4096)],
                                       static_bytes=11.2 * GB, at_tokens=4096)
    assert with_allocated_growth(normal, allocated) == normal  # reserved grows as allocated does: unchanged
