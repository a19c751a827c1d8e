"""The FP8 step's host-side changes on the card (issue 44): the same results as the old path, without the host
waits they removed. Skipped without CUDA, unsloth or FP8 tensor cores.

python -m pytest tests/training/test_gpu_step_host.py -q -m gpu
"""

from __future__ import annotations

import pytest

from tests.training.conftest import fp8_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = fp8_gpu_marks("unsloth")


def test_packed_labels_reach_the_gpu_without_draining_its_stream():
    """Unsloth's boundary-label mask copied the host lengths with a blocking copy (a stream sync every forward)."""
    from unsloth.utils import packing

    from jobs.training.backends.unsloth import enable_async_packed_labels

    labels = torch.arange(40, device="cuda").view(1, 40)
    lengths = torch.tensor([7, 20, 13], dtype=torch.int32)
    shipped = packing._normalize_packed_lengths
    torch.cuda.set_sync_debug_mode("error")
    try:
        if not getattr(shipped, "_nightshift", False):
            with pytest.raises(RuntimeError, match="synchroniz"):
                packing.mask_packed_boundary_labels(labels, lengths)
        assert enable_async_packed_labels() in ("patched", "native")
        got = packing.mask_packed_boundary_labels(labels, lengths)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = labels.clone().view(-1)
    want[[7, 27, 0]] = -100  # each following sample's first token; the last cumsum (40) goes to 0, as shipped
    assert torch.equal(got.view(-1), want)


@pytest.mark.parametrize("kind", ["qkv", "mlp"])
def test_cached_lora_casts_train_exactly_as_casting_in_each_forward_on_the_card(kind, monkeypatch):
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    from jobs.training.fp8.lora import FP8LoraMLP, FP8LoraQKV
    from jobs.training.fp8.matmul import FP8Base, FP8Group

    k = 512
    shapes = [(512, k), (128, k), (128, k)] if kind == "qkv" else [(1024, k), (1024, k), (k, 1024)]

    def run(cache: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setenv("NIGHTSHIFT_FP8_CAST_CACHE", cache)
        torch.manual_seed(0)
        bases = [FP8Base.from_weight(torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02) for o, i in shapes]
        params = [torch.nn.Parameter(t) for o, i in shapes for t in (torch.randn(16, i, device="cuda") * 0.1,
                                                                     torch.randn(o, 16, device="cuda") * 0.1)]
        groups = ((FP8Group(bases, keep_transposed=False),) if kind == "qkv" else
                  (FP8Group([bases[1], bases[0]], keep_transposed=False), FP8Group([bases[2]], keep_transposed=False)))
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        outs = []
        for _ in range(4):
            x = torch.randn(1, 1000, k, device="cuda", generator=g).to(torch.bfloat16)
            args = [t for i in range(3) for t in (params[2 * i], params[2 * i + 1], 1.0)]
            ys = (FP8LoraQKV.apply(x, *groups, *args) if kind == "qkv" else
                  (FP8LoraMLP.apply(x, *groups, *args, swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel),))
            outs += [y.detach().clone() for y in ys]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return outs, [p.detach().clone() for p in params]

    before, after = run("0"), run("1")
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))


class _Heavy(torch.nn.Module):
    """Long GPU work per forward and backward, little host work: a step the host queues far ahead of the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 4096, device="cuda", dtype=torch.bfloat16)
        self.w = torch.nn.Parameter(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01)

    def forward(self, input_ids, labels, use_cache=False, position_ids=None, attention_mask=None):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        h = self.emb(input_ids).expand(8, -1, -1).reshape(-1, 4096)
        for _ in range(24):
            h = torch.tanh(h @ self.w)
        return SimpleNamespace(loss=h.float().pow(2).mean())


@pytest.mark.parametrize("sync", ["0", "1"])
def test_the_step_returns_with_its_loss_while_the_gpu_still_runs_its_backward(sync, monkeypatch):
    from jobs.data.batching import Batch
    from jobs.training.step import make_optimizer, model_inputs, train_step

    monkeypatch.setenv("NIGHTSHIFT_STEP_SYNC", sync)
    torch.manual_seed(0)
    model = _Heavy()
    ids = [[i % 60 for i in range(2048)]]
    batch = Batch(input_ids=ids, labels=ids, attention_mask=None, position_ids=None, sample_ids=[0])
    opt = make_optimizer(model)
    train_step(model, batch, opt)  # warm-up (cuBLAS, allocator)
    torch.cuda.synchronize()
    with torch.no_grad():
        want = float(model(**model_inputs(batch, "cuda")).loss)
    st = train_step(model, batch, opt)
    pending = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert st.loss == pytest.approx(want, rel=1e-6)  # the loss of this step's forward, before its update
    assert pending == (sync == "0")
