"""The preference objective: DPO (Rafailov et al. 2023, the sigmoid loss) over chosen/rejected pairs.

loss = -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))
where log pi(x) is the sum of the policy's log-probabilities of the reply's tokens (the trained labels of
the rendered conversation, as the supervised path labels them: jobs/data/render.py).

The reference is the version in service. The night starts from it (the adapter in service, or the bare base
when none is in service), so before the first update the policy *is* the reference: its log-probabilities
are computed once, without grad, by the same model before it is stepped (TRL's precompute_ref_log_probs).
Why not a second copy, or a second adapter switched in and out: no extra weights in memory and one
reference forward per pair in all, instead of one per pair per epoch. They are written to the run's checkpoint
directory, and a run killed and started again reads them back instead of computing them twice. (This loop
writes no mid-run checkpoints yet: a killed preference run starts its training over from the version in
service, with the same reference.)

Pairs are packed: the chosen and the rejected conversation of several pairs share one row (positions reset,
so no sequence attends to another: jobs/training/packing.py), cut to `tokens_per_step` real tokens of both
replies. The night reports its rate in the plan's units (each pair's chosen conversation, as the ledger counts
it) per second of this objective (both replies, the reference pass): jobs/night/preference.py.

Why DPO and not others: it needs pairs only, no reward model and no sampling during the night (which
would need the inference stack inside the window); IPO/KTO are variants of the same loss shape that can
be added as `objective` values over the same pairs and log-probabilities.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import Emit, ProgressEvent
from jobs.data.batching import IGNORE_INDEX, Batch, TokenizedSample
from jobs.data.formats import RecordError
from jobs.data.preference import is_pair, pair_messages
from jobs.data.render import tokenize_record
from jobs.training.packing import pack

log = structlog.get_logger("nightshift.train")
REFERENCE_FILE = "dpo_reference.pt"


@dataclass(frozen=True)
class Pair:
    sample_id: int
    chosen: TokenizedSample
    rejected: TokenizedSample

    @property
    def n_tokens(self) -> int:
        return self.chosen.n_tokens + self.rejected.n_tokens


def dpo_loss(policy_chosen: Any, policy_rejected: Any, ref_chosen: Any, ref_rejected: Any,
             beta: float) -> tuple[Any, Any, Any]:
    """Mean DPO loss over pairs, and each pair's implicit rewards (beta * log-ratio), chosen and rejected."""
    import torch.nn.functional as F

    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected).mean(), chosen.detach(), rejected.detach()


def pairs_from_records(tokenizer: Any, rows: Sequence[tuple[int, dict[str, Any]]], *, max_seq_length: int,
                       overlong: Any = "reject", special_tokens: Any = "escape") -> tuple[list[Pair], list[int]]:
    """The pairs among `rows` (sample id, normal form) tokenised; and the ids that are no pair (left out)."""
    pairs, others = [], []
    for sid, record in rows:
        if not is_pair(record):
            others.append(sid)
            continue
        chosen, rejected = pair_messages(record)
        try:
            c, r = (tokenize_record(tokenizer, sid, {"messages": m}, max_seq_length=max_seq_length,
                                    overlong=overlong, special_tokens=special_tokens) for m in (chosen, rejected))
        except RecordError as e:  # the pull checked both; a changed config may refuse one now
            log.warning("pair_left_out", sample_id=sid, reason=e.reason, detail=e.detail)
            others.append(sid)
            continue
        pairs.append(Pair(sid, c, r))
    return pairs, others


def pair_rows(pairs: Sequence[Pair], tokens_per_step: int) -> Iterator[list[Pair]]:
    """Pairs in order, grouped so that a row holds at most `tokens_per_step` tokens of both replies (a pair
    over the budget gets a row of its own): the rows are a function of the pairs alone."""
    row: list[Pair] = []
    used = 0
    for p in pairs:
        if row and used + p.n_tokens > tokens_per_step:
            yield row
            row, used = [], 0
        row.append(p)
        used += p.n_tokens
    if row:
        yield row


def packed_row(row: Sequence[Pair]) -> Batch:
    """One packed row: every pair's chosen then rejected sequence (sequence 2k is chosen, 2k+1 rejected)."""
    return pack([s for p in row for s in (p.chosen, p.rejected)])


def sequence_logps(model: Any, batch: Batch, device: Any) -> Any:
    """Sum of log-probabilities of each packed sequence's labelled tokens: a tensor of [sequences]."""
    import torch

    from jobs.training.step import is_unsloth, model_inputs

    inputs = model_inputs(batch, device, unsloth=is_unsloth(model))
    labels = inputs.pop("labels")[0]
    target = labels[1:]
    keep = target != IGNORE_INDEX
    # only the replies' positions go to fp32 and through the softmax: the prompts' logits (most of a row, at
    # a vocabulary of 128k) are never copied
    logits = model(**inputs).logits[0, :-1][keep].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target[keep].unsqueeze(-1)).squeeze(-1)
    seq = torch.cumsum((torch.tensor(batch.position_ids[0], device=logp.device) == 0).long(), 0) - 1
    out = torch.zeros(len(batch.sample_ids), dtype=logp.dtype, device=logp.device)
    return out.index_add(0, seq[1:][keep], logp)


def reference_logps(model: Any, rows: Sequence[list[Pair]], device: Any) -> list[Any]:
    """The version in service's log-probabilities of every row's sequences (the policy before its first step)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [sequence_logps(model, packed_row(r), device).detach().cpu() for r in rows]
    finally:
        model.train(was_training)


@dataclass
class PreferenceResult:
    """What a preference run did, in the units the night reports (jobs/night/candidate.py)."""

    trained_ids: list[int]
    tokens: int  # real tokens of both replies, policy passes (what the plan's rate counts)
    seconds: float  # policy steps and the reference pass
    steps: int
    mean_loss: float | None
    stopped: str | None
    reward_accuracy: float | None  # training pairs, as stepped
    mean_margin: float | None
    loss_curve: list[tuple[int, float]]
    reference_seconds: float = 0.0


def train_preference(model: Any, pairs: Sequence[Pair], *, beta: float, lr: float, epochs: int = 1,
                     tokens_per_step: int, deadline: float, stop: threading.Event, device: Any = "cpu",
                     clock: Callable[[], float] = time.time, emit: Emit = lambda _: None,
                     max_grad_norm: float | None = 1.0, reference_file: Path | None = None) -> PreferenceResult:
    """DPO over `pairs` (in order, `epochs` times) until done, the deadline or `stop`. A pair counts as trained
    once all its epochs ran. `reference_file`: where the reference log-probabilities are kept (read back when
    it exists: a resumed run's policy has moved; written otherwise)."""
    import torch

    rows = list(pair_rows(pairs, tokens_per_step))
    t0 = clock()
    if reference_file is not None and reference_file.exists():
        refs = torch.load(reference_file)
    else:
        refs = reference_logps(model, rows, device)
        if reference_file is not None:
            tmp = reference_file.with_suffix(".tmp")
            torch.save(refs, tmp)
            tmp.replace(reference_file)
    ref_seconds = clock() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    steps, tokens, losses, curve, right, margins = 0, 0, [], [], 0, []
    done_rows, stopped, last = 0, None, 0.0
    for epoch in range(epochs):
        for k, row in enumerate(rows):
            if stop.is_set() or clock() + last >= deadline:  # a step that would end past the deadline: not begun
                stopped = "signal" if stop.is_set() else "deadline"
                break
            began = clock()
            batch = packed_row(row)
            logps = sequence_logps(model, batch, device)
            ref = refs[k].to(logps.device)
            loss, rc, rr = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta)
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            last = clock() - began
            tokens += batch.real_tokens
            losses.append(float(loss.detach()))
            curve.append((steps, losses[-1]))
            right += int((rc > rr).sum())
            margins += (rc - rr).tolist()
            if epoch == epochs - 1:
                done_rows = k + 1
            spent = clock() - t0
            emit(ProgressEvent(fraction=min(1.0, (epoch * len(rows) + k + 1) / (epochs * len(rows))), tokens=tokens,
                               steps=steps, samples=sum(len(r) for r in rows[:k + 1]), loss=losses[-1],
                               tokens_per_second=tokens / spent if spent > 0 else 0.0))
        if stopped:
            break
    trained = [p.sample_id for r in rows[:done_rows] for p in r]  # only rows whose last epoch ran
    return PreferenceResult(
        trained_ids=trained, tokens=tokens, seconds=clock() - t0, steps=steps,
        mean_loss=sum(losses) / len(losses) if losses else None, stopped=stopped,
        reward_accuracy=right / len(margins) if margins else None,
        mean_margin=sum(margins) / len(margins) if margins else None, loss_curve=curve,
        reference_seconds=ref_seconds)


def pair_margins(model: Any, pairs: Sequence[Pair], device: Any, tokens_per_step: int = 4096) -> list[float]:
    """log pi(chosen) - log pi(rejected) of each pair under `model` (no grad): how far it prefers the chosen
    reply. The gate compares these before and after the night (jobs/night/preference_gate.py)."""
    out: list[float] = []
    for logps in reference_logps(model, list(pair_rows(pairs, tokens_per_step)), device):
        out += (logps[0::2] - logps[1::2]).tolist()
    return [m if math.isfinite(m) else 0.0 for m in out]
