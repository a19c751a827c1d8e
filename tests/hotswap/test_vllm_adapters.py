"""[[adapters]] with the real vLLM (the session's server, tests/hotswap/conftest.py): after one night of two
adapters on one base, the server holds both, each under its own versioned name, and each answers greedy prompts
token for token as transformers + PEFT do with that adapter's own published version."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.conftest import hang_bound
from tests.fixtures.real_vllm import MAX_LORA_RANK, VllmServer, greedy_in_process, load_in_process, prompt_ids

pytestmark = pytest.mark.vllm


def test_both_adapters_of_one_night_are_served_as_peft_answers(vllm_server: VllmServer, tiny_model: Path,
                                                                tmp_path: Path) -> None:
    from jobs.night.config import NightConfig
    from jobs.night.several.config import AdapterConfig, with_adapters
    from jobs.night.several.night import run_adapters
    from jobs.store.paths import StatePaths
    from tests.conftest import alpaca, write_jsonl

    for name, tag in (("arith", ""), ("polite", " please")):
        write_jsonl(tmp_path / f"{name}-in" / "d.jsonl", [alpaca(i, tag) for i in range(30)])
    base = NightConfig.model_validate({
        "state_dir": tmp_path / "state", "model": {"path": tiny_model, "name": "tiny"},
        "sources": [{"name": f"{n}-in", "inbox": tmp_path / f"{n}-in", "settle_seconds": 0}
                    for n in ("arith", "polite")],
        "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.1},
        "train": {"backend": "hf", "lora_rank": 4, "lora_alpha": 8, "learning_rate": 2e-2, "batch_size": 8,
                  "batching": "padded", "max_seq_length": 128, "gradient_checkpointing": False},
        "eval": {"min_eval_samples": 1},
        "hotswap": {"targets": [{"kind": "vllm", "name": "vllm", "base_url": vllm_server.url, "retries": 0,
                                 "max_lora_rank": MAX_LORA_RANK, "timeout_s": hang_bound(120), "keep_loaded": 1}]}})
    cfg = with_adapters(base, [AdapterConfig(name="arith", sources=["arith-in"]),
                               AdapterConfig(name="polite", sources=["polite-in"], train={"lora_rank": 8})])
    s = run_adapters(cfg, night="2026-11-21", deadline=time.time() + 3600, emit=lambda ev: None,
                     stop=threading.Event())
    assert [(x.adapter, x.outcome.value, x.promoted) for x in s.adapters] == [
        ("arith", "succeeded", True), ("polite", "succeeded", True)], s.error
    prompts = prompt_ids(tiny_model)
    served = vllm_server.models()
    answers = {}
    for x in s.adapters:
        assert x.hotswap and x.hotswap[0].ok, x.hotswap
        name = x.hotswap[0].detail["lora_name"]
        assert name.startswith(f"{x.adapter}-v0001-") and name in served  # its own name, both held at once
        published = StatePaths(cfg.state_dir).adapter(x.adapter).current.resolve()
        want = greedy_in_process(load_in_process(tiny_model, published), prompts)
        answers[x.adapter] = [vllm_server.greedy(name, p) for p in prompts]
        assert answers[x.adapter] == want, x.adapter
    assert answers["arith"] != answers["polite"]  # two adapters, two answers: neither served the other's weights
