"""The optimizer choice by method and memory, and the step-in-backward optimizer (CPU)."""

from __future__ import annotations

import pytest

from jobs.training.config import TrainConfig
from jobs.training.optim import OptimizerChoice, build_optimizer, choose_optimizer, static_bytes

B8 = 8_030_000_000  # Llama-3.1-8B's parameters


def pick(method: str = "full", *, cap: float | None = 48.0, cuda: bool = True, bnb: bool = True, **train) -> tuple:
    c = choose_optimizer(TrainConfig(method=method, **train), trainable=B8, param_bytes=2, cuda=cuda, cap_gb=cap,
                         bnb=bnb)
    return c.kind, c.in_backward


def test_full_fine_tuning_takes_the_fastest_optimizer_that_fits():
    assert static_bytes(B8, 2, "adamw", False) / 1e9 == pytest.approx(64.2, abs=0.1)  # w + g + 2 bf16 moments
    assert static_bytes(B8, 2, "adamw_8bit", True) / 1e9 == pytest.approx(32.1, abs=0.1)
    assert pick(cap=48) == ("adamw_8bit", True)  # the 8B under max_vram_gb = 48: 32 GB of 48
    assert pick(cap=80) == ("adamw_8bit", False)  # 48 GB of 80
    assert pick(cap=141) == ("adamw", False)  # an H200 with no cap: 64 GB of 141
    assert pick(cap=80, bnb=False) == ("adamw", True)  # no bitsandbytes: the step in backward instead
    assert pick(cap=20) == ("adamw_8bit", True)  # nothing fits: the smallest, and calibrate will say
    c = choose_optimizer(TrainConfig(method="full"), trainable=B8, param_bytes=2, cuda=True, cap_gb=20, bnb=True)
    assert "more than 70% of 20 GB" in c.reason and c.static_gb == pytest.approx(32.1, abs=0.1)


def test_lora_methods_and_the_cpu_keep_plain_adamw_and_config_wins():
    assert pick("qlora") == pick("lora") == ("adamw", False)
    assert pick(cuda=False, bnb=False) == ("adamw", False)
    assert pick(cap=141, optimizer="adamw_8bit") == ("adamw_8bit", False)
    assert pick(cap=141, optimizer_in_backward=True) == ("adamw", True)
    assert pick(cap=48, optimizer="adamw", optimizer_in_backward=False) == ("adamw", False)  # as told
    with pytest.raises(ValueError, match=r'optimizer = "adamw_8bit" needs CUDA and bitsandbytes'):
        pick(cuda=False, optimizer="adamw_8bit")


def test_the_step_in_backward_equals_adamw_and_round_trips_its_state():
    """Same weights after two steps as torch's AdamW stepping after backward (no clipping), the
    scheduler drives its learning rate, no gradient is left behind, its state resumes."""
    import torch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    cfg = TrainConfig(method="full", learning_rate=1e-2, weight_decay=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    ref, mine = model(), model()
    plain = build_optimizer(ref, cfg, None, device="cpu")
    fused = build_optimizer(mine, cfg, OptimizerChoice("adamw", True, "test"), device="cpu")
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 * (s + 1)) for o in (plain, fused)]
    for _ in range(2):
        for m, o, sch in ((ref, plain, scheds[0]), (mine, fused, scheds[1])):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            sch.step()
            o.zero_grad(set_to_none=True)
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert all(p.grad is None for p in mine.parameters())
    assert fused.param_groups[0]["lr"] == pytest.approx(1e-2 * 1.5)
    state = fused.state_dict()
    again = build_optimizer(model(), cfg, OptimizerChoice("adamw", True, "test"), device="cpu")
    again.load_state_dict(state)
    steps = [s["step"] for o in again.inner.values() for s in o.state.values()]
    assert steps and all(int(s) == 2 for s in steps)
