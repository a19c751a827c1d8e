"""What the training tests on the GPU share: the small random Llama they train, and random samples."""

from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from jobs.training.models.architectures import build_random_model

    return build_random_model("small-llama", tmp_path_factory.mktemp("models") / "small-llama")


def fp8_card() -> bool:
    """CUDA with FP8 tensor cores (what the FP8 GPU tests need besides their libraries)."""
    import torch

    if not torch.cuda.is_available():
        return False
    from jobs.training.fp8.compute import assess_card, card_info

    return assess_card(card_info())[0]


def fp8_gpu_marks(library: str) -> list[pytest.MarkDecorator]:
    """The marks of a module of FP8 GPU tests that also need `library`: gpu, and skipped where they cannot run."""
    import importlib.util

    ok = importlib.util.find_spec(library) is not None and fp8_card()
    return [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"needs CUDA with FP8 tensor cores and {library}")]


def random_samples(n: int, vocab: int, seed: int = 0, lengths: tuple[int, int] = (20, 300)):
    """`n` samples of random ids (labels = ids), lengths uniform in `lengths`."""
    from jobs.data.batching import TokenizedSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(*lengths))]
        out.append(TokenizedSample(i, ids, list(ids)))
    return out
