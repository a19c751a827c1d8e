"""The LoRA weights' bf16 casts made once per optimizer step, after it (issue 44): the same training, fewer launches
in the forward, and never a stale cast (jobs/training/fp8/lora_cast.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.training.fp8.lora import FP8LoraMLP, FP8LoraQKV
from jobs.training.fp8.matmul import FP8Base, FP8Group
from jobs.training.fp8.selftest import swiglu_backward_ref, swiglu_forward_ref


class _Casts(TorchDispatchMode):
    """Counts fp32 -> bf16 copies of LoRA-sized tensors (one side at most 24)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        first = args[0][0] if func is torch.ops.aten.cat.default else args[0]
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.cat.default) and \
                first.dtype == torch.float32 and first.dim() == 2 and min(first.shape) <= 24:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _layer(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    k = 64
    shapes = [(32, k)] * 3 if kind == "qkv" else [(128, k), (128, k), (k, 128)]
    bases = [FP8Base.from_weight(torch.randn(o, i) * 0.02) for o, i in shapes]
    params = [torch.nn.Parameter(t) for o, i in shapes for t in (torch.randn(8, i) * 0.1, torch.randn(o, 8) * 0.1)]
    groups = ((FP8Group(bases, keep_transposed=False),) if kind == "qkv" else
              (FP8Group([bases[1], bases[0]], keep_transposed=False), FP8Group([bases[2]], keep_transposed=False)))
    return groups, params


def _forward(kind: str, groups, params, x):
    args = [t for i in range(3) for t in (params[2 * i], params[2 * i + 1], 1.0)]
    if kind == "qkv":
        return FP8LoraQKV.apply(x, *groups, *args)
    return (FP8LoraMLP.apply(x, *groups, *args, swiglu_forward_ref, swiglu_backward_ref),)


def _train(kind: str, steps: int, monkeypatch, cache: str, *, between=None):
    """Steps of fused AdamW (which changes the weights without bumping their versions) on one layer; the outputs
    of every forward and the count of cast launches in each."""
    monkeypatch.setenv("NIGHTSHIFT_FP8_CAST_CACHE", cache)
    groups, params = _layer(kind)
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    outs, casts = [], []
    for i in range(steps):
        x = torch.randn(1, 40, 64, generator=g).to(torch.bfloat16)
        with _Casts() as c:
            ys = _forward(kind, groups, params, x)
        casts.append(c.n)
        outs.append([y.detach().clone() for y in ys])
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if between is not None:
            between(i, params)
    return outs, casts, params


@pytest.mark.parametrize("kind", ["qkv", "mlp"])
def test_after_a_step_the_forward_casts_nothing_and_trains_exactly_as_before(kind, monkeypatch):
    off, casts_off, p_off = _train(kind, 4, monkeypatch, "0")
    on, casts_on, p_on = _train(kind, 4, monkeypatch, "1")
    for a, b in zip(off, on, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert all(torch.equal(u, v) for u, v in zip(p_off, p_on, strict=True))
    assert casts_on[0] == casts_off[0] > 0  # before any step: cast in the forward, as before
    assert casts_on[1:] == [0, 0, 0] and casts_off[1:] == casts_off[:1] * 3


def test_weights_changed_outside_a_step_are_cast_again(monkeypatch):
    """load_state_dict / copy_ between steps (a resume, the numerics check's restore): the forward sees the new
    weights, not the casts of the step before."""
    def restore(i, params):
        if i == 1:
            with torch.no_grad():
                params[0].copy_(params[0] * 0.5)

    off, _, _ = _train("qkv", 4, monkeypatch, "0", between=restore)
    on, casts, _ = _train("qkv", 4, monkeypatch, "1", between=restore)
    assert casts[2] > 0 and casts[3] == 0
    for a, b in zip(off, on, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_a_step_that_raises_halfway_leaves_no_cast_in_use(monkeypatch):
    from jobs.training.fp8.lora_cast import CACHE

    monkeypatch.setenv("NIGHTSHIFT_FP8_CAST_CACHE", "1")
    groups, params = _layer("qkv")
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    x = torch.randn(1, 40, 64).to(torch.bfloat16)
    for _ in range(2):
        ys = _forward("qkv", groups, params, x)
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        opt.step()
    assert CACHE.get([params[0], params[2], params[4]], [params[1], params[3], params[5]], torch.bfloat16) is not None

    def boom(_opt, _args, _kwargs):
        with torch.no_grad():
            params[0].data.add_(1.0)  # changed without a version bump (as fused AdamW does), then the step fails
        raise RuntimeError("halfway")

    h = opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="halfway"):
        opt.step()
    h.remove()
    assert CACHE.get([params[0], params[2], params[4]], [params[1], params[3], params[5]], torch.bfloat16) is None
