"""Train: one readable routine (setup / train / checkpoint / save), no trainer hierarchy.

Runs only in the night's child process. It continues from the adapter in service,
checkpoints every `checkpoint_every_seconds` (adapter + optimizer + position in the
batch sequence) so a killed run resumes where it stopped without training a sample
twice, and stops early enough to save before the deadline.

Cut samples, not epochs: while the first epoch runs, the loop projects the end of the run from
the throughput it measures; when the rest would not fit before the deadline, it cuts whole
samples it has not reached yet (from the tail) out of every epoch, so the others still get all
their epochs and the cut ones stay pending for the next night. A sample counts as trained only
once all its epochs ran; if the deadline still stops a later epoch, the samples it did not
finish stay pending too. The loss of every step is kept (the night's loss curve).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from jobs.contract import Emit, OomSplitEvent, ProgressEvent, StepShape
from jobs.data.batching import Batch, TokenizedSample, padded_batches
from jobs.training.checkpoints import save_checkpoint
from jobs.training.config import TrainConfig
from jobs.training.load import Loaded

log = structlog.get_logger("nightshift.train")


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
    detail: dict[str, Any] = field(default_factory=dict)
    cut_ids: list[int] = field(default_factory=list)  # cut whole before their first step (time ran short)
    partial_ids: list[int] = field(default_factory=list)  # stopped before their last epoch: not trained
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # (optimizer step, loss)


Cut = tuple[int, list[int]]  # (batch index the cut was made at, sample ids cut)


def plan_batches(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int,
                 tokens_per_step: int, cuts: Sequence[Cut] = ()) -> list[Batch]:
    """The whole run's batch sequence, deterministic from (samples, seed, step shape, cuts): a resume replays it."""
    return _plan(samples, cfg, pad_id, tokens_per_step, cuts)[0]


def _plan(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int, tokens_per_step: int,
          cuts: Sequence[Cut]) -> tuple[list[Batch], int]:
    """(batches, how many of them are the first epoch's). Each cut keeps the batches before it and
    packs the rest of the first epoch again without the cut samples; later epochs leave them out."""
    import random

    from jobs.training.packing import packed_batches

    def pack(order: list[TokenizedSample]) -> list[Batch]:
        if cfg.batching == "packed":
            return list(packed_batches(order, tokens_per_step=tokens_per_step))
        return list(padded_batches(order, batch_size=cfg.batch_size, max_tokens_per_batch=cfg.max_tokens_per_batch,
                                   pad_id=pad_id))

    first = pack(list(samples))  # first epoch in plan order (oldest first); later epochs shuffled
    gone: set[int] = set()
    for at, ids in cuts:
        gone |= set(ids)
        done = {sid for b in first[:at] for sid in b.sample_ids}
        first = first[:at] + pack([s for s in samples if s.sample_id not in done | gone])
    kept = [s for s in samples if s.sample_id not in gone]
    out = list(first)
    for epoch in range(1, cfg.epochs):
        order = list(kept)
        random.Random(cfg.seed + epoch).shuffle(order)
        out.extend(pack(order))
    return out, len(first)


def _to_cut(batches: Sequence[Batch], i: int, first_len: int, tokens_over: float, epochs: int) -> list[int]:
    """Samples of the first epoch not reached yet (batches i..), from the tail, whose tokens over all
    epochs cover `tokens_over`."""
    seen = {sid for b in batches[:i] for sid in b.sample_ids}
    tail: list[tuple[int, int]] = []  # (sample id, real tokens)
    for b in batches[i:first_len]:
        lengths = _lengths(b)
        tail += [(sid, n) for sid, n in zip(b.sample_ids, lengths, strict=True) if sid not in seen]
    out, removed = [], 0.0
    for sid, n in reversed(tail):
        if removed >= tokens_over:
            break
        out.append(sid)
        removed += n * epochs
    return out


def _lengths(b: Batch) -> list[int]:
    if b.attention_mask is not None:  # padded: one sample per row
        return [sum(row) for row in b.attention_mask]
    return [b.real_tokens // max(1, len(b.sample_ids))] * len(b.sample_ids)  # packed: an even share is enough


# ---- the loop -----------------------------------------------------------------------------------

def train(
    loaded: Loaded, samples: Sequence[TokenizedSample], cfg: TrainConfig, *, ckpt_root: Path, deadline: float,
    stop: threading.Event, shape: StepShape, clock: Callable[[], float] = time.time,
    emit: Emit = lambda _: None, resume: Path | None = None, save_seconds: float = 5.0,
) -> TrainResult:
    """Train `samples` (in order, `cfg.epochs` times) until done, the deadline or `stop`; emits
    ProgressEvent (version unset: the night knows it) and OomSplitEvent."""
    import torch

    from jobs.training.step import train_step

    model, device = loaded.model, loaded.device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=device == "cuda")
    warm = max(1, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    state: dict[str, Any] = {"next_batch": 0, "steps": 0, "tokens": 0, "seconds": 0.0, "loss_sum": 0.0,
                             "loss_n": 0, "halved": False, "tokens_per_step": shape.tokens_per_step, "cuts": [],
                             "loss_curve": []}

    def step_event(ev: OomSplitEvent) -> None:  # from now on every step runs as two halves (also after a resume)
        state["halved"] = True
        log.warning("cuda_out_of_memory_step_halved", tokens=ev.tokens, halves=ev.halves)
        emit(ev)

    if resume is not None:
        state = {"cuts": [], "loss_curve": [], **json.loads((resume / "state.json").read_text())}
        opt = torch.load(resume / "optimizer.pt", map_location=device, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        # the batch sequence the checkpoint counted in, even if calibrate changed the step shape since
        shape = shape.model_copy(update={"tokens_per_step": int(state.get("tokens_per_step", shape.tokens_per_step))})
    pad_id = loaded.tokenizer.pad_token_id
    batches, first_len = _plan(samples, cfg, pad_id, shape.tokens_per_step, state["cuts"])
    if resume is not None:
        log.info("resumed_from_checkpoint", checkpoint=str(resume), next_batch=state["next_batch"],
                 of=len(batches))
    resumed_from = int(state["next_batch"])
    model.train()
    started = clock()
    seconds_before = float(state["seconds"])
    last_ckpt = clock()
    step_ema: float | None = None
    stopped: str | None = None
    last_progress = 0.0
    total_tokens = sum(b.real_tokens for b in batches)
    tokens_here = 0  # this attempt's, for its throughput
    i = resumed_from
    while i < len(batches):
        now = clock()
        if stop.is_set():
            stopped = "signal"
            break
        if step_ema is not None and now + 1.5 * step_ema + save_seconds > deadline:
            stopped = "deadline"
            break
        if step_ema is not None and i < first_len and i - resumed_from >= 3:
            rate = tokens_here / max(1e-9, clock() - started)  # tokens/s measured this attempt
            left = deadline - now - save_seconds - 1.5 * step_ema
            over = (sum(b.real_tokens for b in batches[i:]) / rate - left) * rate * 1.1
            cut = _to_cut(batches, i, first_len, over, cfg.epochs) if over > 0 else []
            if cut:
                state["cuts"].append([i, cut])
                batches, first_len = _plan(samples, cfg, pad_id, shape.tokens_per_step, state["cuts"])
                total_tokens = sum(b.real_tokens for b in batches)
                log.info("samples_cut", samples=len(cut), at_batch=i, batches=len(batches),
                         reason="the rest of the run would not fit before the deadline")
                if i >= len(batches):
                    break
        st = train_step(model, batches[i], optimizer, device=device, scheduler=scheduler, params=params,
                        on_event=step_event, halve=bool(state.get("halved")))
        loss, dt = st.loss, st.seconds
        step_ema = dt if step_ema is None else 0.8 * step_ema + 0.2 * dt
        state["next_batch"] = i + 1
        state["steps"] += 1
        state["tokens"] += batches[i].real_tokens
        state["loss_sum"] += loss
        state["loss_n"] += 1
        state["loss_curve"].append([state["steps"], loss])
        tokens_here += batches[i].real_tokens
        state["seconds"] = seconds_before + (clock() - started)
        if clock() - last_ckpt >= cfg.checkpoint_every_seconds and i + 1 < len(batches):
            save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
            last_ckpt = clock()
        if clock() - last_progress >= 1.0 or i + 1 == len(batches):
            last_progress = clock()
            tps = state["tokens"] / state["seconds"] if state["seconds"] > 0 else 0.0
            remaining = total_tokens - sum(b.real_tokens for b in batches[: i + 1])
            emit(ProgressEvent(fraction=(i + 1) / len(batches), tokens=state["tokens"], planned_tokens=total_tokens,
                               steps=state["steps"], samples=len(_consumed(batches, i + 1)), tokens_per_second=tps,
                               eta=clock() + remaining / tps if tps > 0 else None, loss=loss))
        i += 1
    if stopped == "signal":
        save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
        log.info("checkpoint_saved_on_stop", next_batch=state["next_batch"], of=len(batches))
    done = int(state["next_batch"])
    consumed = _consumed(batches, done)
    last = {sid: k for k, b in enumerate(batches) for sid in b.sample_ids}  # each sample's last batch
    trained = [sid for sid in consumed if last[sid] < done]
    return TrainResult(
        trained_ids=trained, partial_ids=[sid for sid in consumed if last[sid] >= done],
        cut_ids=[sid for _, ids in state["cuts"] for sid in ids],
        loss_curve=[(int(st), float(v)) for st, v in state["loss_curve"]],
        tokens=int(state["tokens"]), seconds=float(state["seconds"]),
        steps=int(state["steps"]), mean_loss=state["loss_sum"] / state["loss_n"] if state["loss_n"] else None,
        stopped=stopped, resumed_from_step=resumed_from,
        detail={"batches": len(batches), "batches_done": int(state["next_batch"]), "halved": state["halved"],
                "tokens_per_step": shape.tokens_per_step, "gradient_checkpointing": shape.gradient_checkpointing,
                "step_shape_basis": shape.basis, "batching": cfg.batching, "cuts": state["cuts"]},
    )


def _consumed(batches: Sequence[Batch], upto: int) -> list[int]:
    seen: dict[int, None] = {}
    for b in batches[:upto]:
        for sid in b.sample_ids:
            seen.setdefault(sid, None)
    return list(seen)
