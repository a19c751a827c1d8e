"""The memory probe against a card whose allocator already holds free space (CPU: torch.cuda's counters faked)."""

from __future__ import annotations

import pytest
import torch

from jobs.training import probe as probe_mod
from jobs.training.models.synthetic import make_samples
from jobs.training.step import StepStat

GB = 1e9


class _Card:
    """Allocated memory: `static` + `per_token` x tokens during a step. Reserved: at least `held` (segments the
    allocator keeps, with free space inside), else allocated + 2 %."""

    def __init__(self, static: float, per_token: float, held: float) -> None:
        self.static, self.per_token, self.held = static, per_token, held
        self.peak_alloc = self.peak_reserved = 0.0

    def reserved_for(self, allocated: float) -> float:
        return max(self.held, 1.02 * allocated)

    def step(self, model, batch, optimizer):
        alloc = self.static + self.per_token * batch.real_tokens
        self.peak_alloc = max(self.peak_alloc, alloc)
        self.peak_reserved = max(self.peak_reserved, self.reserved_for(alloc))
        return StepStat(tokens=batch.real_tokens, seconds=0.1, loss=1.0)

    def reset(self) -> None:
        self.peak_alloc = self.peak_reserved = 0.0


@pytest.mark.parametrize(("held_gb", "why"), [(24.6, "holes"), (0.0, "none")])
def test_the_probe_budgets_by_the_growth_it_measures_even_inside_held_memory(monkeypatch, held_gb, why):
    """The 8B's calibrate on an H200 (FP8, a q,v adapter, 40 GB cap): 24.6 GB reserved after the warm-up (the
    same model's all-projection calibrate: 10.2), no probe peaked higher, so the budget went to 32,768 tokens.
    Here 10.2 GB allocated inside 24.6 held: the step the budget allows must stay under the cap either way."""
    card = _Card(static=10.2 * GB, per_token=2.3e6, held=held_gb * GB)
    for name, fn in {
        "synchronize": lambda *a: None, "empty_cache": lambda: None, "reset_peak_memory_stats": card.reset,
        "memory_reserved": lambda *a: card.reserved_for(card.static),
        "memory_allocated": lambda *a: card.static,
        "max_memory_reserved": lambda *a: card.peak_reserved, "max_memory_allocated": lambda *a: card.peak_alloc,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(probe_mod, "train_step", card.step)
    settings = probe_mod.ProbeSettings(max_vram_gb=40, min_tokens=2048, max_tokens=32768)
    res = probe_mod.probe_memory(torch.nn.Module(), make_samples("wiki", 60_000, vocab=1000, cap=2048), settings,
                                 optimizer=None)
    assert res.tokens_per_step is not None
    truth = card.reserved_for(card.static + card.per_token * res.tokens_per_step)
    assert truth <= (40 - settings.headroom_gb) * GB, (why, res.tokens_per_step, res.memory)
    assert res.tokens_per_step >= 4096  # and the budget is still a real one
    assert all("peak_allocated_gb" in p for p in res.probes)
