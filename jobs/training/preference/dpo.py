"""The preference objective: DPO (Rafailov et al. 2023, the sigmoid loss) over chosen/rejected pairs.

loss = -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))
where log pi(x) is the sum of the policy's log-probabilities of the reply's tokens (the trained labels of
the rendered conversation, as the supervised path labels them: jobs/data/render.py).

The reference is the version in service. The night starts from it (the adapter in service, or the bare base
when none is in service), so before the first update the policy *is* the reference: its log-probabilities
are computed once, without grad, by the same model before it is stepped (TRL's precompute_ref_log_probs).
Why not a second copy, or a second adapter switched in and out: no extra weights in memory and one
reference forward per pair in all, instead of one per pair per epoch. They are written to the run's checkpoint
directory (with the held-out pairs' margins the gate compares with), and a run killed and started again reads them
back: its policy has moved since. The run checkpoints as the supervised loop does (jobs/training/checkpoints.py:
adapter, optimizer, position, rotated in whole, at its crash points), so a preference night killed mid-training
resumes from its last checkpoint and trains every row of pairs once.

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
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import NonNegativeInt

from jobs.contract import Emit, ProgressEvent
from jobs.contract.crashpoints import reached
from jobs.data.batching import IGNORE_INDEX, Batch, TokenizedSample
from jobs.data.formats import RecordError
from jobs.data.preference import is_pair, pair_messages
from jobs.data.render import tokenize_record
from jobs.store.files import PRIVATE_DIR, PRIVATE_FILE, fsync_dir, make_dir
from jobs.training.checkpoints import save_checkpoint
from jobs.training.loop import COUNTED, STEPPED
from jobs.training.loop_state import LoopState
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


class PreferenceState(LoopState):
    """A preference run's position and counts, as its checkpoint keeps them (the loop's state, plus what the
    training pairs' reward accuracy and margin are summed from). `next_batch` counts rows over all epochs."""

    right: NonNegativeInt = 0  # stepped pairs whose implicit reward was higher for the chosen reply
    margin_sum: float = 0.0
    margin_n: NonNegativeInt = 0


@dataclass(frozen=True)
class Reference:
    """What the version in service said, computed once per run before the first step and kept beside the
    checkpoints: every row's sequence log-probabilities, and the held-out pairs' margins (the gate's "before")."""

    rows: list[Any]  # one tensor of [sequences] a row
    heldout_before: list[float]
    tokens_per_step: int  # the rows were cut at this size: a resume cuts them the same way


def read_reference(path: Path, tokens_per_step: int | None = None) -> Reference | None:
    """The kept reference, or None when it is missing, unreadable or cut at another size."""
    import torch

    try:
        doc = torch.load(path, weights_only=True)
        ref = Reference(rows=list(doc["rows"]), heldout_before=[float(x) for x in doc["heldout_before"]],
                        tokens_per_step=int(doc["tokens_per_step"]))
    except Exception as e:  # any damage means: computed again from the version in service
        if path.exists():
            log.warning("dpo_reference_unusable", file=str(path), problem=f"{type(e).__name__}: {e}")
        return None
    if tokens_per_step is not None and ref.tokens_per_step != tokens_per_step:
        return None
    return ref


def write_reference(path: Path, ref: Reference) -> None:
    """Private, fsynced, then renamed into place: a kill leaves the old file or the whole new one."""
    import torch

    make_dir(path.parent, PRIVATE_DIR)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save({"rows": ref.rows, "heldout_before": ref.heldout_before, "tokens_per_step": ref.tokens_per_step},
                   f)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, PRIVATE_FILE)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass
class PreferenceResult:
    """What a preference run did, in the units the night reports (jobs/night/candidate.py), over all its
    attempts (a resumed run's counts include what its checkpoint held)."""

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
    heldout_before: list[float] = field(default_factory=list)
    resumed_from: int = 0  # the row (over all epochs) this attempt began at: 0 unless resumed from a checkpoint
    rows: int = 0  # rows over all epochs
    warmup_tokens: int = 0  # chosen conversations' tokens of each attempt's first step (the plan's units)
    warmup_seconds: float = 0.0


def dpo_step(model: Any, batch: Batch, ref: Any, optimizer: Any, params: Sequence[Any], *, beta: float,
             device: Any, max_grad_norm: float | None = 1.0) -> tuple[float, Any, Any]:
    """One optimizer step of DPO on a packed row (sequence 2k chosen, 2k+1 rejected): its loss and the pairs'
    implicit rewards. The night's loop and calibrate's timed steps both step through here."""
    import torch

    logps = sequence_logps(model, batch, device)
    ref = ref.to(logps.device)
    m = logps.shape[0] // 2 * 2  # calibrate's memory probe packs rows of any samples: an odd last one is unpaired
    if m:
        loss, rc, rr = dpo_loss(logps[0:m:2], logps[1:m:2], ref[0:m:2], ref[1:m:2], beta)
    else:
        loss, rc, rr = (logps * 0.0).sum(), logps[:0].detach(), logps[:0].detach()
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), rc, rr


def preference_optimizer(model: Any, lr: float) -> tuple[list[Any], Any, Any]:
    """The trainable weights, AdamW over them and a constant schedule (what a checkpoint saves beside them)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, fused=bool(params) and params[0].is_cuda)
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def train_preference(model: Any, pairs: Sequence[Pair], *, beta: float, lr: float, epochs: int = 1,
                     tokens_per_step: int, deadline: float, stop: threading.Event, device: Any = "cpu",
                     clock: Callable[[], float] = time.time, emit: Emit = lambda _: None,
                     max_grad_norm: float | None = 1.0, reference_file: Path | None = None,
                     heldout: Sequence[Pair] = (), ckpt_root: Path | None = None, resume: Path | None = None,
                     checkpoint_every: float = 600.0) -> PreferenceResult:
    """DPO over `pairs` (in order, `epochs` times) until done, the deadline or `stop`. A pair counts as trained
    once all its epochs ran. `reference_file`: where the reference (and the held-out pairs' margins before the
    first step) is kept: read back when it exists, written otherwise. `ckpt_root`: checkpoints every
    `checkpoint_every` seconds and on a stop (jobs/training/checkpoints.py, the supervised loop's);
    `resume`: the checkpoint this attempt continues from (its model already loaded from it), which trains
    every later row once: the position, optimizer and counts come from it, the reference from the kept file."""
    import torch

    rows = list(pair_rows(pairs, tokens_per_step))
    t0 = clock()
    ref = read_reference(reference_file, tokens_per_step) if reference_file is not None else None
    if ref is None or len(ref.rows) != len(rows):
        if resume is not None:  # the policy has moved: the version in service cannot be read from it
            raise ValueError(f"resuming from {resume} needs the reference kept beside it ({reference_file})")
        refs = reference_logps(model, rows, device)
        ref_seconds = clock() - t0  # training time (the plan's rate counts it); the held-out margins are the gate's
        ref = Reference(rows=refs, heldout_before=pair_margins(model, heldout, device, tokens_per_step),
                        tokens_per_step=tokens_per_step)
        if reference_file is not None:
            write_reference(reference_file, ref)
    else:
        ref_seconds = clock() - t0
    params, optimizer, scheduler = preference_optimizer(model, lr)
    state = PreferenceState(next_batch=0, steps=0, tokens_per_step=tokens_per_step)
    if resume is not None:
        state = PreferenceState.model_validate_json((resume / "state.json").read_bytes())
        opt = torch.load(resume / "optimizer.pt", map_location=device, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        log.info("resumed_from_checkpoint", checkpoint=str(resume), next_batch=state.next_batch,
                 of=epochs * len(rows))
    else:
        state.seconds = ref_seconds
    resumed_from, total = state.next_batch, epochs * len(rows)
    # progress in the plan's units (the chosen conversations' tokens), as the summary and the plan count them:
    # counting both replies showed twice the tokens and twice the rate of the summary (RESULTS.md: 2026-11-28,
    # 8B DPO night)
    chosen = [0]
    for r in rows:
        chosen.append(chosen[-1] + sum(p.chosen.n_tokens for p in r))

    def plan_tokens(done: int) -> int:
        return done // len(rows) * chosen[-1] + chosen[done % len(rows)] if rows else 0

    model.train()
    started, seconds_before, last_ckpt, stopped, last = clock(), state.seconds, clock(), None, 0.0
    while state.next_batch < total:
        g = state.next_batch
        k = g % len(rows)
        if stop.is_set() or clock() + last >= deadline:  # a step that would end past the deadline: not begun
            stopped = "signal" if stop.is_set() else "deadline"
            break
        began = clock()
        batch = packed_row(rows[k])
        loss, rc, rr = dpo_step(model, batch, ref.rows[k], optimizer, params, beta=beta, device=device,
                                max_grad_norm=max_grad_norm)
        scheduler.step()
        reached(STEPPED)
        last = clock() - began
        if g == resumed_from:  # each attempt's first step compiles: overhead, as the supervised loop counts it
            state.warmup_seconds += last
            state.warmup_tokens += sum(p.chosen.n_tokens for p in rows[k])  # the plan's units
        state.next_batch, state.steps = g + 1, state.steps + 1
        state.tokens += batch.real_tokens
        state.loss_sum, state.loss_n = state.loss_sum + loss, state.loss_n + 1
        state.loss_curve.append((state.steps, loss))
        state.right += int((rc > rr).sum())
        state.margin_sum += float((rc - rr).sum())
        state.margin_n += len(rc)
        state.seconds = seconds_before + (clock() - started)
        reached(COUNTED)
        if ckpt_root is not None and clock() - last_ckpt >= checkpoint_every and state.next_batch < total:
            saving = clock()
            save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
            last_ckpt = clock()
            state.checkpoints += 1
            state.checkpoint_seconds += last_ckpt - saving
        spent, done = state.seconds, plan_tokens(state.next_batch)
        per_step = (clock() - started) / (state.next_batch - resumed_from)  # this attempt's steps so far
        emit(ProgressEvent(fraction=state.next_batch / total, tokens=done, planned_tokens=plan_tokens(total),
                           steps=state.steps, samples=sum(len(r) for r in rows[:k + 1]), loss=loss,
                           tokens_per_second=done / spent if spent > 0 else 0.0,
                           eta=time.time() + (total - state.next_batch) * per_step))
    if stopped == "signal" and ckpt_root is not None and state.next_batch > resumed_from:
        save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
        log.info("checkpoint_saved_on_stop", next_batch=state.next_batch, of=total)
    done_rows = max(0, state.next_batch - (epochs - 1) * len(rows))  # rows whose last epoch ran
    trained = [p.sample_id for r in rows[:done_rows] for p in r]
    return PreferenceResult(
        trained_ids=trained, tokens=state.tokens, seconds=state.seconds, steps=state.steps,
        mean_loss=state.loss_sum / state.loss_n if state.loss_n else None, stopped=stopped,
        reward_accuracy=state.right / state.margin_n if state.margin_n else None,
        mean_margin=state.margin_sum / state.margin_n if state.margin_n else None,
        loss_curve=list(state.loss_curve), reference_seconds=ref_seconds if resume is None else 0.0,
        heldout_before=list(ref.heldout_before), resumed_from=resumed_from, rows=total,
        warmup_tokens=state.warmup_tokens, warmup_seconds=state.warmup_seconds)


def pair_margins(model: Any, pairs: Sequence[Pair], device: Any, tokens_per_step: int = 4096) -> list[float]:
    """log pi(chosen) - log pi(rejected) of each pair under `model` (no grad): how far it prefers the chosen
    reply. The gate compares these before and after the night (jobs/night/preference_gate.py)."""
    out: list[float] = []
    for logps in reference_logps(model, list(pair_rows(pairs, tokens_per_step)), device):
        out += (logps[0::2] - logps[1::2]).tolist()
    return [m if math.isfinite(m) else 0.0 for m in out]
