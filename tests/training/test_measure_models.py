"""What the gate measures, through both backends: scoring without labels returns logits, the base is the
adapter disabled, and another version's adapter weights are swapped in for its measurement (the service's,
the reference's, after training) and the candidate's put back. The Unsloth variant runs through the device
tool (skipped without CUDA/unsloth):

python -m pytest tests/training/test_measure_models.py -q -m gpu
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def check_base_and_reference(model: Any, pad_id: int, device: str, vocab: int, tmp_path: Path) -> None:
    import types

    from jobs.data.batching import TokenizedSample
    from jobs.learning import evaluate
    from jobs.night.measure import _run_swapped

    rng = random.Random(0)
    samples = []
    for i in range(8):
        ids = [rng.randrange(10, vocab - 10) for _ in range(40)]
        mask = [False] * 30 + [True] * 8 + [False] * 2
        samples.append(TokenizedSample(i, ids, [-100] * 30 + ids[30:], reply_mask=mask))

    def loss() -> float:
        m = evaluate.eval_metrics(model, samples, pad_id=pad_id, device=device, max_tokens_per_batch=4096)
        assert m and 0 <= m["exact_match"] <= 1 and 0 <= m["token_accuracy"] <= 1
        return m["loss"]

    def set_b(value: float | None) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.zero_() if value is None else p.add_(torch.randn_like(p) * value)

    fresh = loss()
    set_b(0.5)  # make the adapter matter, and keep it as "another version"
    other = loss()
    model.save_pretrained(str(tmp_path / "v1"))
    with model.disable_adapter():
        assert loss() == pytest.approx(fresh, rel=1e-3)  # a fresh LoRA (B = 0) is the base
    assert other != pytest.approx(fresh, rel=1e-3)
    set_b(None)  # the candidate: the base again
    ctx, seen = types.SimpleNamespace(summary=types.SimpleNamespace(not_evaluated={})), []
    assert _run_swapped(ctx, model, tmp_path / "v1", "reference", lambda: seen.append(loss()), None)
    assert seen == [pytest.approx(other, rel=1e-3)]  # the other version's weights
    assert loss() == pytest.approx(fresh, rel=1e-3)  # the candidate's weights are back


def test_base_and_reference_through_transformers_and_peft(tiny_model: Path, tmp_path: Path) -> None:
    from jobs.contract import StepShape
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    loaded = load_for_training(tiny_model, TrainConfig(backend="hf", lora_rank=4), adapter=None,
                               shape=StepShape(tokens_per_step=512, gradient_checkpointing=False, basis="test"))
    check_base_and_reference(loaded.model, loaded.tokenizer.pad_token_id, loaded.device, 2048, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("unsloth") is None,
                    reason="needs CUDA and unsloth")
def test_base_and_reference_through_unsloth(tmp_path: Path) -> None:
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.models.architectures import build_random_model

    path = build_random_model("small-llama", tmp_path / "small-llama")
    model, tok, _ = load_unsloth(path, lora=LoraSpec(r=16, alpha=16), max_seq_length=2048,
                                 gradient_checkpointing=False, cache_dir=tmp_path / "state")
    check_base_and_reference(model, tok.pad_token_id or 0, "cuda", 32000, tmp_path)
