"""Train: one readable routine (setup / train / checkpoint / save), no trainer hierarchy.

Runs only in the night's child process. It continues from the adapter in service,
checkpoints every `checkpoint_every_seconds` (adapter + optimizer + position in the
batch sequence) so a killed run resumes where it stopped without training a sample
twice, and stops early enough to save before the deadline.
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
from jobs.training.distributed import SOLO, Solo
from jobs.training.load import Loaded

log = structlog.get_logger("nightshift.train")


@dataclass
class TrainResult:
    """What a run of the loop did (the night turns it into the summary and the manifest)."""

    trained_ids: list[int]  # consumed at least once (in order)
    tokens: int  # real (non-padding) tokens processed, all epochs
    seconds: float
    steps: int
    mean_loss: float | None
    stopped: Literal["deadline", "signal"] | None  # None: finished
    resumed_from_step: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


def plan_batches(samples: Sequence[TokenizedSample], cfg: TrainConfig, pad_id: int,
                 tokens_per_step: int) -> list[Batch]:
    """The whole run's batch sequence, deterministic from (samples, seed, step shape): a resume replays it."""
    import random

    from jobs.training.packing import packed_batches

    out: list[Batch] = []
    for epoch in range(cfg.epochs):
        order = list(samples)
        if epoch:  # first epoch in plan order (oldest first); later epochs shuffled
            random.Random(cfg.seed + epoch).shuffle(order)
        if cfg.batching == "packed":
            out.extend(packed_batches(order, tokens_per_step=tokens_per_step))
        else:
            out.extend(padded_batches(order, batch_size=cfg.batch_size,
                                      max_tokens_per_batch=cfg.max_tokens_per_batch, pad_id=pad_id))
    return out


# ---- the loop -----------------------------------------------------------------------------------

def train(
    loaded: Loaded, samples: Sequence[TokenizedSample], cfg: TrainConfig, *, ckpt_root: Path, deadline: float,
    stop: threading.Event, shape: StepShape, clock: Callable[[], float] = time.time,
    emit: Emit = lambda _: None, resume: Path | None = None, save_seconds: float = 5.0, group: Solo = SOLO,
) -> TrainResult:
    """Train `samples` (in order, `cfg.epochs` times) until done, the deadline or `stop`; emits
    ProgressEvent (version unset: the night knows it) and OomSplitEvent.

    [distributed] `group`: with several ranks each global step is `group.world` consecutive rows of the
    batch sequence, one per rank; the position counts rows, so a checkpoint holds the global position
    (and a resume with another number of ranks continues from it). Rank 0 alone saves checkpoints."""
    import torch

    model, device = loaded.model, loaded.device
    params = [p for p in model.parameters() if p.requires_grad]
    group.start(params)  # [distributed] wait for every rank, then take rank 0's weights
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=device == "cuda")
    warm = max(1, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    state = {"next_batch": 0, "steps": 0, "tokens": 0, "seconds": 0.0, "loss_sum": 0.0, "loss_n": 0,
             "halved": False, "tokens_per_step": shape.tokens_per_step}

    def step_event(ev: OomSplitEvent) -> None:  # from now on every step runs as two halves (also after a resume)
        state["halved"] = True
        log.warning("cuda_out_of_memory_step_halved", tokens=ev.tokens, halves=ev.halves)
        emit(ev)

    if resume is not None:
        state = json.loads((resume / "state.json").read_text())
        opt = torch.load(resume / "optimizer.pt", map_location=device, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        # the batch sequence the checkpoint counted in, even if calibrate changed the step shape since
        shape = shape.model_copy(update={"tokens_per_step": int(state.get("tokens_per_step", shape.tokens_per_step))})
    batches = plan_batches(samples, cfg, loaded.tokenizer.pad_token_id, shape.tokens_per_step)
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
    for i in range(resumed_from, len(batches), group.world):
        rows = batches[i: i + group.world]  # [distributed] one row per rank (one row: one process)
        now = clock()
        # [distributed] decided together: every rank stops at the same step, whatever its own clock says
        signalled, late = group.agree(stop.is_set(),
                                      step_ema is not None and now + 1.5 * step_ema + save_seconds > deadline)
        if signalled:
            stopped = "signal"
            break
        if late:
            stopped = "deadline"
            break
        st = group.step(model, rows, optimizer, device=device, scheduler=scheduler, params=params,
                        on_event=step_event, halve=bool(state.get("halved")))
        if st.split:  # [distributed] an out-of-memory on any rank: every rank halves from now on
            state["halved"] = True
        loss, dt = st.loss, st.seconds
        step_ema = dt if step_ema is None else 0.8 * step_ema + 0.2 * dt
        done = i + len(rows)  # rows consumed: the global position
        state["next_batch"] = done
        state["steps"] += 1
        state["tokens"] += sum(b.real_tokens for b in rows)
        state["loss_sum"] += loss
        state["loss_n"] += 1
        state["seconds"] = seconds_before + (clock() - started)
        if group.is_owner and clock() - last_ckpt >= cfg.checkpoint_every_seconds and done < len(batches):
            save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
            last_ckpt = clock()
        if clock() - last_progress >= 1.0 or done == len(batches):
            last_progress = clock()
            tps = state["tokens"] / state["seconds"] if state["seconds"] > 0 else 0.0
            remaining = total_tokens - sum(b.real_tokens for b in batches[:done])
            emit(ProgressEvent(fraction=done / len(batches), tokens=state["tokens"], planned_tokens=total_tokens,
                               steps=state["steps"], samples=len(_consumed(batches, done)), tokens_per_second=tps,
                               eta=clock() + remaining / tps if tps > 0 else None, loss=loss))
    if stopped == "signal" and group.is_owner:
        save_checkpoint(ckpt_root, model, optimizer, scheduler, state)
        log.info("checkpoint_saved_on_stop", next_batch=state["next_batch"], of=len(batches))
    group.finish()  # [distributed] the other ranks' peak memory for rank 0's summary
    consumed = _consumed(batches, int(state["next_batch"]))
    return TrainResult(
        trained_ids=consumed, tokens=int(state["tokens"]), seconds=float(state["seconds"]),
        steps=int(state["steps"]), mean_loss=state["loss_sum"] / state["loss_n"] if state["loss_n"] else None,
        stopped=stopped, resumed_from_step=resumed_from,
        detail={"batches": len(batches), "batches_done": int(state["next_batch"]), "halved": state["halved"],
                "tokens_per_step": shape.tokens_per_step, "gradient_checkpointing": shape.gradient_checkpointing,
                "step_shape_basis": shape.basis, "batching": cfg.batching, "world_size": group.world},
    )


def _consumed(batches: Sequence[Batch], upto: int) -> list[int]:
    seen: dict[int, None] = {}
    for b in batches[:upto]:
        for sid in b.sample_ids:
            seen.setdefault(sid, None)
    return list(seen)
