"""A CUDA out-of-memory step is retried as two halves, and every later step of the run is halved up front.

CPU stand-in: a wrapper raises torch.OutOfMemoryError for rows longer than a limit.
"""

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from jobs.contract import StepShape  # noqa: E402
from jobs.data.batching import TokenizedSample  # noqa: E402
from jobs.training.config import TrainConfig  # noqa: E402
from jobs.training.load import Loaded  # noqa: E402
from jobs.training.loop import train  # noqa: E402
from jobs.training.packing import packed_batches  # noqa: E402
from jobs.training.step import model_inputs, train_step  # noqa: E402


class OomAbove(torch.nn.Module):
    def __init__(self, model, limit):
        super().__init__()
        self.model, self.limit, self.rows = model, limit, []

    def forward(self, **inputs):
        n = inputs["input_ids"].shape[1]
        self.rows.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError("fake: row too long for this card")
        return self.model(**inputs)


def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def samples(n, length=10):
    return [TokenizedSample(i, [1 + (i + j) % 60 for j in range(length)], [-100] + [1 + (i + j) % 60
            for j in range(1, length)]) for i in range(n)]


def test_an_oom_step_is_retried_as_two_halves():
    model = OomAbove(tiny(), limit=25)
    batch = next(packed_batches(samples(4), tokens_per_step=40))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    events = []
    st = train_step(model, batch, opt, device="cpu", on_event=events.append)
    assert st.split and st.tokens == 40 and torch.isfinite(torch.tensor(st.loss))
    assert model.rows == [40, 20, 20] and events[0].event == "oom_split" and events[0].halves == [20, 20]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it stepped


def test_after_an_oom_every_later_step_of_the_run_is_halved_up_front(tmp_path):
    from types import SimpleNamespace

    model = OomAbove(tiny(), limit=25)
    loaded = Loaded(model, SimpleNamespace(pad_token_id=0), "hf", "cpu", {})
    cfg = TrainConfig(batching="packed", tokens_per_step=40, max_seq_length=16, epochs=1, warmup_steps=0)
    events = []
    res = train(loaded, samples(12), cfg, ckpt_root=tmp_path / "ckpt", deadline=time.time() + 600,
                stop=threading.Event(), shape=StepShape(tokens_per_step=40, gradient_checkpointing=False, basis="test"),
                emit=events.append)
    assert res.steps == 3 and res.detail.halved and len(res.trained_ids) == 12
    assert model.rows == [40, 20, 20, 20, 20, 20, 20]  # one failed full-size attempt, then halves only
    assert [e.event for e in events if e.event != "progress"] == ["oom_split"]


class OomAfterForward(torch.nn.Module):
    """Raises the out-of-memory after its forward made activations (as a real one does mid-backward), and
    records whether the failed attempt's activations were still alive when the next forward began."""

    def __init__(self, model, limit):
        super().__init__()
        self.model, self.limit, self.alive_at_next = model, limit, []
        self._last = None

    def forward(self, **inputs):
        import weakref

        self.alive_at_next.append(self._last is not None and self._last() is not None)
        out = self.model(**inputs)
        self._last = weakref.ref(out.logits)
        if inputs["input_ids"].shape[1] > self.limit:
            raise torch.OutOfMemoryError("fake: the backward would not fit")
        return out


def test_the_failed_attempts_activations_are_gone_before_the_halves_run():
    """On a full card the halves fit only in what the failed attempt held: its traceback must be dropped
    (the handler left) before they run, not kept alive through the retry."""
    model = OomAfterForward(tiny(), limit=25)
    batch = next(packed_batches(samples(4), tokens_per_step=40))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    st = train_step(model, batch, opt, device="cpu")
    assert st.split
    assert model.alive_at_next[1] is False  # the first half began with the whole batch's logits freed


def test_packed_unsloth_inputs_end_with_a_tensor_on_the_device():
    """Unsloth's full fine-tuning picks the autocast device from the last tensor argument: the host-side
    segment lengths must not be that tensor (on the GPU, fp32 norms met bf16 weights)."""
    from jobs.training.packing import pack

    out = model_inputs(pack(samples(3)), "meta", unsloth=True)
    tensors = [v for v in out.values() if torch.is_tensor(v)]
    assert "packed_seq_lengths" in out and out["packed_seq_lengths"].device.type == "cpu"
    assert tensors[-1].device.type == "meta"
