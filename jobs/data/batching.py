"""Turn tokenised samples into training batches.

Batches are cut by a token budget (padded tokens count: they cost compute), so
short and long samples give steps of similar cost. The order of samples is kept:
a resumed run skips exactly the samples its checkpoint already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

IGNORE_INDEX = -100  # label value that the loss skips (prompt tokens, padding)


@dataclass(frozen=True)
class TokenizedSample:
    sample_id: int
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where not trained on
    # True where a trained token is the reply's own text, False for the template's markers around it
    # (end of turn, newline): what answer-level metrics count. None: every trained token is reply.
    reply_mask: list[bool] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Plain lists; the training backend turns them into tensors on its device."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    attention_mask: list[list[int]] | None
    position_ids: list[list[int]] | None
    sample_ids: list[int] = field(default_factory=list)
    real_tokens: int = 0  # non-padding tokens (what tok/s counts)


def padded_batches(
    samples: Sequence[TokenizedSample], *, batch_size: int, max_tokens_per_batch: int, pad_id: int
) -> Iterator[Batch]:
    """Right-padded batches of at most `batch_size` samples and `max_tokens_per_batch` padded tokens."""
    group: list[TokenizedSample] = []
    longest = 0
    for s in samples:
        new_longest = max(longest, s.n_tokens)
        if group and (len(group) >= batch_size or new_longest * (len(group) + 1) > max_tokens_per_batch):
            yield _pad(group, pad_id)
            group, new_longest = [], s.n_tokens
        group.append(s)
        longest = new_longest
    if group:
        yield _pad(group, pad_id)


def _pad(group: list[TokenizedSample], pad_id: int) -> Batch:
    width = max(s.n_tokens for s in group)
    ids, labels, mask = [], [], []
    for s in group:
        pad = width - s.n_tokens
        ids.append(s.input_ids + [pad_id] * pad)
        labels.append(s.labels + [IGNORE_INDEX] * pad)
        mask.append([1] * s.n_tokens + [0] * pad)
    return Batch(
        input_ids=ids,
        labels=labels,
        attention_mask=mask,
        position_ids=None,
        sample_ids=[s.sample_id for s in group],
        real_tokens=sum(s.n_tokens for s in group),
    )
