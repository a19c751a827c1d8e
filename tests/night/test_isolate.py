"""Forgetting measured (the KL of the candidate from the service) and a rejected night's files told apart
(issue 39), on a tiny hand-made language model: fast, CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from jobs.data.batching import IGNORE_INDEX, TokenizedSample  # noqa: E402
from jobs.learning.evaluate import SampleScore  # noqa: E402
from jobs.night import drift, isolate  # noqa: E402
from jobs.night.measure import EvalSets  # noqa: E402

V = 12


class TinyLM(torch.nn.Module):
    """Next token from the current one: logits = W[input]; the HF-style loss over shifted labels."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(V, V))

    def forward(self, input_ids: Any, labels: Any = None, **_: Any) -> Any:
        logits = self.w[input_ids]
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                                                     ignore_index=IGNORE_INDEX)
        return SimpleNamespace(logits=logits, loss=loss)


def sample(sid: int, prompt: int, answer: int) -> TokenizedSample:
    return TokenizedSample(sid, [prompt, answer], [IGNORE_INDEX, answer])


def loaded(model: Any) -> Any:
    return SimpleNamespace(model=model, device="cpu", tokenizer=SimpleNamespace(pad_token_id=0))


KW = {"pad_id": 0, "device": "cpu", "max_tokens_per_batch": 4096}


def test_the_kl_from_the_service_is_zero_for_the_same_model_and_the_exact_kl_otherwise():
    samples = [sample(i, 1 + i % 5, 2) for i in range(6)]
    cand, service = TinyLM(0), TinyLM(1)
    view = drift.candidate_view(cand, samples, **KW)
    assert drift.kl_from_view(cand, samples, view, **KW).kl == pytest.approx(0, abs=1e-6)
    d = drift.kl_from_view(service, samples, view, **KW)
    p = torch.log_softmax(cand.w[[s.input_ids[0] for s in samples]], -1)  # the exact KL (top-k holds all V)
    q = torch.log_softmax(service.w[[s.input_ids[0] for s in samples]], -1)
    assert d.samples == 6 and d.tokens == 6
    assert d.kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean().detach()), rel=1e-4)


def test_a_file_contradicting_what_the_candidate_lost_is_blamed_an_unrelated_one_is_not():
    """The candidate learned a wrong file (prompt 1 -> 4) on top of what the regression set holds (1 -> 3);
    a clean file teaches another prompt (5 -> 7). Only the wrong one's gradient undoes what was lost."""
    model = TinyLM(0)
    with torch.no_grad():
        model.w[1] = torch.zeros(V)
        model.w[1, 4] = 6.0  # the candidate answers 4 where the regression set says 3
    target = [sample(100 + i, 1, 3) for i in range(4)]
    groups = {1: [sample(i, 5, 7) for i in range(8)], 2: [sample(10 + i, 1, 4) for i in range(8)]}
    yardstick = [sample(200 + i, 1, 3) for i in range(4)]  # replay: what earlier nights taught
    b = isolate.blame(loaded(model), target, groups, yardstick, 4096)
    assert b is not None and b.blamed == [2], b
    assert b.harm[2] > 0.5 and b.yardstick < 0 and abs(b.harm[1]) < 0.1


def test_the_lost_samples_are_those_the_anchor_answered_and_the_candidate_did_not():
    s = [sample(i, 1, 3) for i in range(4)]
    right, wrong = SampleScore(0.1, 1, True, 1, 1), SampleScore(3.0, 1, False, 1, 0)
    sets = EvalSets(heldout=[], regression=s, cache=None)  # type: ignore[arg-type]
    sets.per_sample = {"regression_reference": {0: right, 1: right, 2: wrong, 3: wrong},
                       "regression_after": {0: right, 1: wrong, 2: wrong, 3: right}}
    assert [x.sample_id for x in isolate.lost_samples(sets, [("regression", "reference")])] == [1]
    assert [x.sample_id for x in isolate.known_samples(sets)] == [0, 3]  # what a later night protects


def test_a_failed_retention_or_per_slice_check_names_its_lost_samples():
    """A night refused by the retention rule, or by one slice of a set ("regression[<source>]"), is scored
    on the samples that check lost (before, neither name found a set: nothing was blamed)."""
    s = [sample(i, 1, 3) for i in range(4)]
    right, wrong = SampleScore(0.1, 1, True, 1, 1), SampleScore(3.0, 1, False, 1, 0)
    sets = EvalSets(heldout=[], regression=s[:2], cache=None, retention=s[2:])  # type: ignore[arg-type]
    sets.per_sample = {"regression_reference": {0: right, 1: right}, "regression_after": {0: wrong, 1: right},
                       "retention_reference": {2: right, 3: right}, "retention_after": {2: right, 3: wrong}}
    assert [x.sample_id for x in isolate.lost_samples(sets, [("retention", "reference")])] == [3]
    assert [x.sample_id for x in isolate.lost_samples(sets, [("regression[inbox]", "reference")])] == [0]
