"""Answer-level metrics: exact match of the reply and token accuracy over the reply's own tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from jobs.data.batching import IGNORE_INDEX  # noqa: E402
from jobs.data.batching import TokenizedSample as S  # noqa: E402
from jobs.learning.evaluate import eval_metrics, score_samples, summarize  # noqa: E402

END = 9  # the template's end-of-turn marker


class NextIsPlusOne(torch.nn.Module):
    """Predicts token t + 1 after token t, with certainty; END after 5."""

    def forward(self, input_ids, attention_mask=None, use_cache=False, position_ids=None):
        nxt = torch.where(input_ids == 5, torch.full_like(input_ids, END), input_ids + 1)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, 16).float() * 20)


def sample(sid: int, reply: list[int]) -> S:
    """prompt 1 2, then the reply and END; labels on the reply and END, the mask on the reply only."""
    ids = [1, 2, *reply, END]
    labels = [IGNORE_INDEX, IGNORE_INDEX, *reply, END]
    return S(sid, ids, labels, reply_mask=[False, False] + [True] * len(reply) + [False])


def metrics(*samples: S) -> dict[str, float]:
    m = eval_metrics(NextIsPlusOne(), list(samples), pad_id=0, device="cpu", max_tokens_per_batch=1024)
    assert m is not None
    return m


def test_a_right_reply_is_an_exact_match():
    m = metrics(sample(1, [3, 4, 5]))
    assert m["exact_match"] == 1.0 and m["token_accuracy"] == 1.0 and m["loss"] < 1e-6 and m["samples"] == 1


def test_a_wrong_reply_scores_zero_although_its_end_marker_is_right():
    """What the old 'accuracy' read as 0.5 (the end marker predicted, the answer not)."""
    wrong_answer_right_end = S(2, [1, 2, 7, 5, END], [IGNORE_INDEX, IGNORE_INDEX, 7, 5, END],
                               reply_mask=[False, False, True, True, False])
    m = metrics(wrong_answer_right_end)
    assert m["exact_match"] == 0.0 and m["token_accuracy"] == 0.0  # 7 and 5 are wrong, END is right
    scores = score_samples(NextIsPlusOne(), [wrong_answer_right_end], pad_id=0, device="cpu", max_tokens_per_batch=64)
    assert scores[2].tokens == 3 and scores[2].reply_tokens == 2 and not scores[2].exact


def test_exact_match_counts_samples_token_accuracy_counts_reply_tokens():
    right, two_wrong = sample(1, [3, 4, 5]), sample(2, [3, 9, 5])  # 9 wrong, and 5 after it (the model says 10)
    m = metrics(right, two_wrong, sample(3, [3]))  # [3]: after 3 the model says 4, not END: exact fails
    assert m["exact_match"] == pytest.approx(1 / 3)
    assert m["token_accuracy"] == pytest.approx(5 / 7)  # reply tokens 3 + 3 + 1, wrong: two
    assert summarize([]) is None
    without_mask = S(4, [1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 3])  # raw text: every trained token is reply
    assert metrics(without_mask)["token_accuracy"] == 1.0


def test_samples_are_batched_shortest_first_so_little_is_padding():
    """A long sample among short ones pads only the batch it is in; every sample keeps its own score."""
    seen: list[tuple[int, int]] = []

    class Spy(NextIsPlusOne):
        def forward(self, input_ids, **kw):
            seen.append(tuple(input_ids.shape))
            return super().forward(input_ids, **kw)

    samples = [sample(i, [3, 4, 5] if i % 2 else [3] * 40) for i in range(128)]  # 6 and 43 tokens, mixed
    scores = score_samples(Spy(), samples, pad_id=0, device="cpu", max_tokens_per_batch=4096)
    assert sorted(scores) == list(range(128))
    assert sorted(seen) == [(64, 6), (64, 43)]  # in arrival order: two batches padded to 43
    alone = score_samples(NextIsPlusOne(), [samples[1]], pad_id=0, device="cpu", max_tokens_per_batch=4096)
    assert scores[1] == alone[1]
