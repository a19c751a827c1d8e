"""How far the candidate moved from the adapter in service, on tonight's data: KL(candidate || service).

The KL divergence of a tuned model from the one before it, on the new data, predicts how much it
forgets (Shenfeld et al. 2025): a per-night figure the operator can watch beside the canary's exact
match. Measured teacher-forced at the trained positions of tonight's samples (held-out first, then new
training samples, `[eval] kl_samples` in all), in nats per token. Vocabularies are large, so the
candidate's distribution is kept as its top TOP_K tokens and one bucket for the rest; the KL of those
coarsened distributions is a lower bound of the full one (the data-processing inequality) and equals
it where the candidate's top tokens hold nearly all its mass, as they do after training.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.learning.evaluate import shifted_logits

TOP_K = 256
View = dict[int, tuple[Any, Any]]  # sample id -> (top token ids [P, k], their log-probabilities [P, k])


@dataclass(frozen=True)
class Drift:
    kl: float  # nats per trained token, mean over the tokens
    samples: int
    tokens: int


def _logprobs(model: Any, samples: Sequence[TokenizedSample], *, pad_id: int, device: str,
              max_tokens_per_batch: int) -> Iterator[tuple[int, Any]]:
    """(sample id, log-probabilities at its trained positions [P, V]) under `model`, in eval mode."""
    import torch

    for sid, logits, labels in shifted_logits(model, samples, pad_id=pad_id, device=device,
                                              max_tokens_per_batch=max_tokens_per_batch, batch_size=16):
        keep = (labels != IGNORE_INDEX).nonzero().squeeze(-1)
        yield sid, torch.log_softmax(logits[keep].float(), dim=-1)


def candidate_view(model: Any, samples: Sequence[TokenizedSample], **kw: Any) -> View:
    """The candidate's top-k next-token distributions, kept on the CPU for the service's pass."""
    out: View = {}
    for sid, lp in _logprobs(model, samples, **kw):
        top = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
        out[sid] = (top.indices.cpu(), top.values.cpu())
    return out


def kl_from_view(model: Any, samples: Sequence[TokenizedSample], view: View, **kw: Any) -> Drift | None:
    """KL(candidate || `model`) per token over the samples of `view` (None: nothing to measure)."""
    total, tokens, n = 0.0, 0, 0
    for sid, lq in _logprobs(model, [s for s in samples if s.sample_id in view], **kw):
        idx, lp = view[sid]
        lp = lp.to(lq.device)
        lq_top = lq.gather(-1, idx.to(lq.device))
        p_tail = (1 - lp.exp().sum(-1)).clamp_min(1e-12)
        q_tail = (1 - lq_top.exp().sum(-1)).clamp_min(1e-12)
        kl = (lp.exp() * (lp - lq_top)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
        total += float(kl.clamp_min(0).sum())
        tokens += int(kl.numel())
        n += 1
    return Drift(kl=total / tokens, samples=n, tokens=tokens) if tokens else None
