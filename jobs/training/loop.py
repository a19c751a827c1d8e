"""Train: one readable routine (setup / train / checkpoint / save), no trainer hierarchy.

Runs only in the night's child process. It continues from the adapter in service,
checkpoints every `checkpoint_every_seconds` (adapter + optimizer + position in the
batch sequence) so a killed run resumes where it stopped without training a sample
twice, and stops early enough to save before the deadline.

Cut samples, not epochs: while the first epoch runs, the loop projects the end of the run from
the throughput it measures; when the rest would not fit before the deadline, it cuts whole
samples it has not reached yet (from the tail) out of every epoch, so the others still get all
their epochs and the cut ones stay pending for the next night (with one epoch nothing is cut: the
deadline's stop leaves the samples not reached pending just the same). A sample counts as trained only
once all its epochs ran; if the deadline still stops a later epoch, the samples it did not
finish stay pending too. The loss of every step is kept (the night's loss curve).

A night without a measurement for its key does not bet the window on its first step (a 16,384-token
step of a slow model once took 337 s in a 3-minute window): two probe steps of about PROBE_TOKENS
each (the first warms up, the second is timed) size the rest, so a step takes at most
1/STEPS_IN_TIME_LEFT of the time left, never more than the configured shape.

Several ranks (jobs/training/ranks/collectives.py): each step is one row of the batch sequence per rank,
and every decision that stops the loop or changes the sequence is the same on every rank.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog

from jobs.contract import Emit, OomSplitEvent, ProgressEvent, StepShape
from jobs.contract.crashpoints import declare, reached
from jobs.data.batching import Batch, TokenizedSample
from jobs.training.batch_sequence import cut_first, later_epochs, probe_sizes, samples_to_cut, sequence
from jobs.training.checkpoints import read_state, save_checkpoint
from jobs.training.config import TrainConfig
from jobs.training.load import Loaded
from jobs.training.loop_state import LoopState, TrainDetail
from jobs.training.ranks.collectives import SOLO, Solo

log = structlog.get_logger("nightshift.train")
STEPPED = declare("train.stepped", "the optimizer stepped; the loop has not counted the step yet")
COUNTED = declare("train.counted", "the loop counted the step (position, steps, tokens); no checkpoint holds it yet")


@dataclass
class TrainResult:
    """What a run of the loop did (the night turns it into the summary and the manifest)."""

    trained_ids: list[int]  # every planned epoch ran (in order of first use)
    tokens: int  # real (non-padding) tokens processed, all epochs
    seconds: float
    steps: int
    mean_loss: float | None
    stopped: Literal["deadline", "signal"] | None  # None: finished
    resumed_from_step: int = 0
    detail: TrainDetail = field(default_factory=TrainDetail)
    cut_ids: list[int] = field(default_factory=list)  # cut whole before their first step (time ran short)
    partial_ids: list[int] = field(default_factory=list)  # stopped before their last epoch: not trained
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # (optimizer step, loss)
    first_step_at: float | None = None  # clock() when this attempt's first step ended
    # each attempt's first step (and the probes): compiles and autotunes, not the steady rate
    warmup_tokens: int = 0
    warmup_seconds: float = 0.0
    # periodic checkpoint saves: training time, but not the training rate (the plan adds them per save)
    checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    # each attempt's steps before its rate settled, beyond the settled rate: overhead, not the rate
    ramp_seconds: float = 0.0


STEPS_IN_TIME_LEFT = 20


# ---- the loop -----------------------------------------------------------------------------------

def train(
    loaded: Loaded, samples: Sequence[TokenizedSample], cfg: TrainConfig, *, ckpt_root: Path, deadline: float,
    stop: threading.Event, shape: StepShape, clock: Callable[[], float] = time.time,
    emit: Emit = lambda _: None, resume: Path | None = None, save_seconds: float = 5.0, probe_first: bool = False,
    group: Solo = SOLO,
) -> TrainResult:
    """Train `samples` (in order, `cfg.epochs` times) until done, the deadline or `stop`; emits
    ProgressEvent (version unset: the night knows it) and OomSplitEvent. `probe_first`: no
    measurement of this key yet: size the steps from two short probe steps first.

    [distributed] `group`: with several ranks each global step is `group.world` consecutive rows of the
    batch sequence, one per rank; the position counts rows, so a checkpoint holds the global position
    (and a resume with another number of ranks continues from it). Rank 0 alone saves checkpoints.
    Every decision that changes the batch sequence or stops the loop is the same on every rank: stop
    and deadline are agreed (any rank), a cut and a probe's resize are rank 0's, handed to the others."""
    import torch

    from jobs.training.optim import build_optimizer

    entered = clock()
    model, device = loaded.model, loaded.device
    params = [p for p in model.parameters() if p.requires_grad]
    group.start(params)  # [distributed] wait for every rank, then take rank 0's weights
    optimizer = build_optimizer(model, cfg, loaded.optim, device=device)  # by method and memory: optim.py
    warm = max(1, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    state = LoopState(next_batch=0, steps=0, tokens_per_step=shape.tokens_per_step)

    def step_event(ev: OomSplitEvent) -> None:  # from now on every step runs as two halves (also after a resume)
        state.halved = True
        log.warning("cuda_out_of_memory_step_halved", tokens=ev.tokens, halves=ev.halves)
        emit(ev)

    probing = probe_first and resume is None
    if resume is not None:
        state = read_state(resume)
        opt = torch.load(resume / "optimizer.pt", map_location=device, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        # the batch sequence the checkpoint counted in, even if the step shape changed since; with less
        # memory free than when it was chosen, its steps run as two halves from the start
        ckpt_tokens = state.tokens_per_step or shape.tokens_per_step
        if shape.tokens_per_step < ckpt_tokens and cfg.batching == "packed":
            state.halved = True
        shape = shape.model_copy(update={"tokens_per_step": ckpt_tokens})
    elif probing:
        state.probe_samples = probe_sizes(samples, world=group.world)
    state.tokens_per_step = state.tokens_per_step or shape.tokens_per_step
    n_probes = len(state.probe_samples)
    pad_id = loaded.tokenizer.pad_token_id

    def replan() -> tuple[list[Batch], int]:
        return sequence(samples, cfg, pad_id, tokens_per_step(), state.probe_samples, state.cuts)

    def tokens_per_step() -> int:
        assert state.tokens_per_step is not None  # set above, from the checkpoint or the shape
        return state.tokens_per_step

    batches, first_len = replan()
    if resume is not None:
        log.info("resumed_from_checkpoint", checkpoint=str(resume), next_batch=state.next_batch,
                 of=len(batches))
    resumed_from = state.next_batch
    model.train()
    started = clock()
    seconds_before = state.seconds
    last_ckpt = clock()
    per_token: float | None = None  # seconds per real token (EMA): the next step's predicted time
    stopped: str | None = None
    last_progress = 0.0
    first_step_at: float | None = None
    total_tokens = sum(b.real_tokens for b in batches)
    # this attempt's throughput, for the cut: from after its first step (a compile) and the probes
    measured_from, since, tokens_here = max(resumed_from + group.world, n_probes), started, 0
    gone = {sid for _, ids in state.cuts for sid in ids}  # cut so far (a resume's cuts included)
    cut_at = -1  # this attempt's last cut: the next one waits for steps measured after it
    steady: deque[float] = deque(maxlen=SLOW_WINDOW)  # seconds per token of the attempt's recent steady steps
    ramp_before = state.ramp_seconds  # earlier attempts' (a resume)
    timed: list[tuple[int, float]] = []  # (tokens, seconds) of this attempt's steps after its warm-up
    i = resumed_from
    while i < len(batches):
        rows = batches[i: i + group.world]  # [distributed] one row per rank (one row: one process)
        now = clock()
        predicted = 1.5 * per_token * _tokens(rows) if per_token is not None else 0.0
        cut: list[int] = []
        # a cut only matters with epochs > 1 (the samples it defers get none of them rather than some): with
        # one, the deadline's stop leaves the samples not reached pending just the same, without repacking
        if (group.is_owner and cfg.epochs > 1 and per_token is not None and i < first_len
                and i - max(measured_from, cut_at) >= 3 * group.world):
            cut = samples_to_cut(batches, i, first_len, rate=tokens_here / max(1e-9, now - since),
                                 left=deadline - now - save_seconds - predicted, epochs=cfg.epochs)
        # [distributed] decided together: every rank stops at the same step, whatever its own clock says
        signalled, late, cutting = group.agree(stop.is_set(), now + predicted + save_seconds > deadline, bool(cut))
        if signalled:
            stopped = "signal"
            break
        if late:
            stopped = "deadline"
            break
        if cutting:  # rank 0's cut, the same on every rank (it changes the batch sequence)
            cut = group.broadcast(cut)
            repacking = clock()
            state.cuts.append((i, cut))
            first = cut_first(samples, batches[:first_len], i, cut, gone, cfg, pad_id, tokens_per_step())
            batches, first_len = first + later_epochs(samples, gone, cfg, pad_id, tokens_per_step()), len(first)
            total_tokens = sum(b.real_tokens for b in batches)
            since += clock() - repacking  # not training time: the rate the next cut is sized by leaves it out
            cut_at = i
            log.info("samples_cut", samples=len(cut), at_batch=i, batches=len(batches),
                     reason="the rest of the run would not fit before the deadline")
            if i >= len(batches):
                break
            rows = batches[i: i + group.world]
        st = group.step(model, rows, optimizer, device=device, scheduler=scheduler, params=params,
                        on_event=step_event, halve=state.halved)
        reached(STEPPED)
        if st.split:  # [distributed] an out-of-memory on any rank: every rank halves from now on
            state.halved = True
        loss, dt = st.loss, st.seconds
        step_rate = dt / max(1, _tokens(rows))  # seconds per token of the global step
        per_token = step_rate if per_token is None or i <= measured_from else 0.8 * per_token + 0.2 * step_rate
        if first_step_at is None:  # the wake's last leg: setting up (optimizer, batches) and a first step's compile
            first_step_at = clock()
            log.info("first_step", seconds=round(dt, 2), setup_seconds=round(started - entered, 2),
                     tokens=_tokens(rows))
        done = i + len(rows)  # rows consumed: the global position
        state.next_batch = done
        state.steps += 1
        state.tokens += _tokens(rows)
        state.loss_sum += loss
        state.loss_n += 1
        state.loss_curve.append((state.steps, loss))
        if i >= measured_from:
            tokens_here += _tokens(rows)
            timed.append((_tokens(rows), dt))
            _note_slow(state, steady, step_rate, dt=dt, tokens=_tokens(rows), step=state.steps)
        else:
            since = clock()
            state.warmup_tokens += _tokens(rows)
            state.warmup_seconds += dt
        state.seconds = seconds_before + (clock() - started)
        reached(COUNTED)
        if probing and i < n_probes <= done:  # after the timed probe, the rest of the steps are sized from it
            fit = (_fit(shape, left=deadline - clock() - save_seconds, per_token=step_rate, world=group.world)
                   if group.is_owner else None)
            if _resize(state, group.broadcast(fit)):  # [distributed] rank 0's measurement on every rank
                batches, first_len = replan()
                total_tokens = sum(b.real_tokens for b in batches)
        if group.is_owner and clock() - last_ckpt >= cfg.checkpoint_every_seconds and done < len(batches):
            saving = clock()
            state.ramp_seconds = ramp_before + ramp_excess(timed)
            save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
            last_ckpt = clock()
            # counted after the save (its own state holds the saves before it): count and seconds agree on resume
            state.checkpoints += 1
            state.checkpoint_seconds += last_ckpt - saving
        if clock() - last_progress >= 1.0 or done == len(batches):
            last_progress = clock()
            tps = state.tokens / state.seconds if state.seconds > 0 else 0.0
            remaining = total_tokens - sum(b.real_tokens for b in batches[:done])
            emit(ProgressEvent(fraction=done / len(batches), tokens=state.tokens, planned_tokens=total_tokens,
                               steps=state.steps, samples=len(_consumed(batches, done)), tokens_per_second=tps,
                               eta=clock() + remaining / tps if tps > 0 else None, loss=loss))
        i = done
    state.ramp_seconds = ramp_before + ramp_excess(timed)
    if stopped == "signal" and group.is_owner:
        save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
        log.info("checkpoint_saved_on_stop", next_batch=state.next_batch, of=len(batches))
    group.finish()  # [distributed] the other ranks' peak memory for rank 0's summary
    done = state.next_batch
    consumed = _consumed(batches, done)
    last = {sid: k for k, b in enumerate(batches) for sid in b.sample_ids}  # each sample's last batch
    trained = [sid for sid in consumed if last[sid] < done]
    step_tokens = tokens_per_step()
    basis = shape.basis
    if state.probe_samples and step_tokens != shape.tokens_per_step:
        basis += f"; steps of {step_tokens:,} tokens, sized from two probe steps (nothing measured yet)"
    return TrainResult(
        trained_ids=trained, partial_ids=[sid for sid in consumed if last[sid] >= done],
        cut_ids=[sid for _, ids in state.cuts for sid in ids],
        loss_curve=list(state.loss_curve), tokens=state.tokens, seconds=state.seconds, steps=state.steps,
        mean_loss=state.loss_sum / state.loss_n if state.loss_n else None,
        stopped=stopped, resumed_from_step=resumed_from, first_step_at=first_step_at,
        warmup_tokens=state.warmup_tokens, warmup_seconds=state.warmup_seconds,
        checkpoints=state.checkpoints, checkpoint_seconds=state.checkpoint_seconds, ramp_seconds=state.ramp_seconds,
        detail=TrainDetail(batches=len(batches), batches_done=done, halved=state.halved, tokens_per_step=step_tokens,
                           gradient_checkpointing=shape.gradient_checkpointing, step_shape_basis=basis,
                           batching=cfg.batching, cuts=list(state.cuts), probe_samples=list(state.probe_samples),
                           world_size=group.world, slow_steps=list(state.slow_steps),
                           step_shape=shape.model_copy(update={"tokens_per_step": step_tokens, "basis": basis})),
    )


RAMP_WINDOW = 8  # steps whose mean time per token must be within RAMP_TOL of the settled rate
RAMP_TOL = 0.03
RAMP_MAX_SECONDS = 120.0  # a slower start that lasts longer is the data's (longer samples first), not a ramp


def ramp_excess(steps: Sequence[tuple[int, float]]) -> float:
    """Seconds the first steps of an attempt took beyond its settled rate (the median seconds per token of
    its second half), up to the first RAMP_WINDOW steps whose mean is within RAMP_TOL of it; 0 with fewer
    than 4 x RAMP_WINDOW steps to judge by, or when the rate has not settled within RAMP_MAX_SECONDS. On one
    H200 an 8B's first night in a new state directory (cold compile caches) ran ~10k tok/s at first and
    ~16.4k after ~30 s: its 1.8 minutes recorded 15,312, and the night planned from that trained 8.6 %
    faster than predicted (RESULTS.md: 2026-11-26, 8B cold first night)."""
    n = len(steps)
    if n < 4 * RAMP_WINDOW:
        return 0.0
    per_token = [s / max(1, t) for t, s in steps]
    settled = statistics.median(per_token[n // 2:])
    elapsed = 0.0
    for k in range(n // 2):
        if statistics.fmean(per_token[k: k + RAMP_WINDOW]) <= settled * (1 + RAMP_TOL):
            return sum(max(0.0, s - t * settled) for t, s in steps[:k])
        elapsed += steps[k][1]
        if elapsed > RAMP_MAX_SECONDS:
            break
    return 0.0


SLOW_STEP = 3.0  # a step this many times the median time per token of the attempt's recent steps
SLOW_WINDOW = 64  # recent steps the median is taken over: bounded work per step, and it follows a drift
MAX_SLOW_NOTED = 20


def _note_slow(state: LoopState, steady: deque[float], rate: float, *, dt: float, tokens: int,
               step: int) -> None:
    """Log (and keep, up to MAX_SLOW_NOTED) a step far slower per token than this attempt's others: a
    recompile, a stall or a neighbour on the card shows where the night's time went."""
    if len(steady) >= 3 and rate > SLOW_STEP * statistics.median(steady):
        typical = statistics.median(steady) * tokens
        # info, not a warning: one slow step (a recompile, a busy CPU) is nothing an operator can act on; the
        # summary keeps them (slow_steps), and a night that misses its plan says so there
        log.info("slow_step", step=step, seconds=round(dt, 3), tokens=tokens, typical_seconds=round(typical, 3))
        if len(state.slow_steps) < MAX_SLOW_NOTED:
            state.slow_steps.append((step, round(dt, 3), round(typical, 3)))
    steady.append(rate)


def _fit(shape: StepShape, *, left: float, per_token: float, world: int) -> int:
    """After the timed probe: tokens of one rank's row, so that a step takes at most 1/STEPS_IN_TIME_LEFT
    of the time left (and holds at most the shape's size). `per_token`: seconds per token of a global step."""
    fit = int(max(0.0, left) / STEPS_IN_TIME_LEFT / max(per_token, 1e-9)) // world
    tokens = max(1, min(shape.tokens_per_step, fit))
    log.info("step_size_from_probe", seconds_per_1k_tokens=round(per_token * 1000, 4), seconds_left=round(left, 1),
             tokens_per_step=tokens, configured=shape.tokens_per_step, ranks=world)
    return tokens


def _resize(state: LoopState, tokens: int) -> bool:
    """Recorded in the state, so a resume rebuilds exactly this batch sequence."""
    if tokens == state.tokens_per_step:
        return False
    state.tokens_per_step = tokens
    return True


def _tokens(rows: Sequence[Batch]) -> int:
    return sum(b.real_tokens for b in rows)


def _consumed(batches: Sequence[Batch], upto: int) -> list[int]:
    seen: dict[int, None] = {}
    for b in batches[:upto]:
        for sid in b.sample_ids:
            seen.setdefault(sid, None)
    return list(seen)
