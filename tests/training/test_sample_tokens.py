"""Samples cut from real tokens (`python -m benchmarks bench --token-file`, the FP8 capture): the profile's lengths,
the file's tokens in order, random ids where the tokenizer covers none of the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.training.fp8.sample_data import RANDOM, sample_tokens
from jobs.training.models.architectures import make_tokenizer
from jobs.training.models.synthetic import make_samples


class _Cfg:
    vocab_size = 512


def test_samples_cut_from_a_pool_keep_the_profile_lengths_and_the_pool_order():
    pool = list(range(100, 400))
    rnd = make_samples("alpaca", 20000, vocab=1000, seed=3)
    cut = make_samples("alpaca", 20000, vocab=1000, seed=3, pool=pool)
    assert [s.n_tokens for s in cut] == [s.n_tokens for s in rnd]
    for s in cut:
        at = pool.index(s.input_ids[0])
        assert s.input_ids == [pool[(at + j) % len(pool)] for j in range(s.n_tokens)]  # a run, wrapping
        assert s.labels == s.input_ids
    with pytest.raises(ValueError, match="empty pool"):
        make_samples("alpaca", 100, vocab=1000, pool=[])


def test_the_tokens_of_a_file_the_tokenizer_covers(tmp_path: Path):
    rows = [{"instruction": " ".join(f"w{(i * 7 + k) % 256}" for k in range(20)), "output": f"w{i % 256} w3"}
            for i in range(400)]
    f = tmp_path / "night1.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = make_tokenizer(_Cfg())
    ids, where = sample_tokens(tok, [f], n=4096)
    assert where == "4096 tokens of night1.jsonl"
    words = set(tok.convert_tokens_to_ids([f"w{i}" for i in range(256)]))
    assert sum(i in words for i in ids) > 0.8 * len(ids)  # the records' words, mostly (the template aside)


def test_random_ids_where_no_data_fits(tmp_path: Path):
    f = tmp_path / "english.jsonl"
    f.write_text(json.dumps({"instruction": "hello there", "output": "general kenobi"}) + "\n")
    ids, where = sample_tokens(make_tokenizer(_Cfg()), [f, tmp_path / "missing.jsonl"], n=128)
    assert where == RANDOM and len(ids) == 128
