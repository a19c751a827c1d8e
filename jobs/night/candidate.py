"""The torch steps of a night: load the model and the night's data, evaluate, train the candidate.

Kept apart from intake (pull, plan) so that those never import torch. A run killed while
training resumes from its last checkpoint; the "before" evaluation of an interrupted attempt is
kept next to the checkpoints, so the candidate is always judged against the adapter it started from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from jobs import evaluate
from jobs.contract import ChildEvent, EvalMetrics, Phase, ProgressEvent, StepShape
from jobs.data.batching import TokenizedSample
from jobs.data.render import tokenize_record
from jobs.night.context import RunContext
from jobs.night.intake import PlannedRun
from jobs.training.checkpoints import latest_checkpoint
from jobs.training.load import Loaded, load_for_training
from jobs.training.loop import TrainResult, train
from jobs.training.shape import resolve_step

log = structlog.get_logger("nightshift.night")
Measured = dict[str, EvalMetrics | None]  # "<heldout|regression>_<before|after>" -> metrics


@dataclass
class Prepared:
    """The loaded model and the night's tokenised data."""

    loaded: Loaded
    shape: StepShape
    train_set: list[TokenizedSample]  # plan order: replay mixed in
    replay_ids: set[int]  # trained again, never re-marked
    heldout_ids: list[int]
    heldout: list[TokenizedSample]
    regression: list[TokenizedSample]
    resume: Path | None  # the checkpoint this attempt continues from


def load_model_and_data(ctx: RunContext, planned: PlannedRun) -> Prepared:
    cfg, ledger = ctx.cfg, ctx.ledger
    parent_path = ctx.registry.path_of(cfg.model.name, planned.parent) if planned.parent else None
    resume = latest_checkpoint(ctx.checkpoints)
    with ctx.phase(Phase.load):
        shape = resolve_step(cfg.train, ledger.calibration(planned.key))
        log.info("step_shape", tokens_per_step=shape.tokens_per_step,
                 gradient_checkpointing=shape.gradient_checkpointing, basis=shape.basis)
        loaded = load_for_training(ctx.model_path, cfg.train, adapter=resume or parent_path, shape=shape,
                                   cache_dir=ctx.state / "models")
        tok, tk = loaded.tokenizer, {"max_seq_length": cfg.train.max_seq_length, "overlong": cfg.train.overlong}
        train_ids = [sid for sid, role in planned.roles if role in ("train", "replay")]
        heldout_ids = [sid for sid, role in planned.roles if role == "heldout"]
        prepared = Prepared(
            loaded=loaded, shape=shape,
            train_set=[tokenize_record(tok, r.id, r.record, **tk) for r in ledger.samples_by_id(train_ids)],
            replay_ids={sid for sid, role in planned.roles if role == "replay"},
            heldout_ids=heldout_ids,
            heldout=[tokenize_record(tok, r.id, r.record, **tk)
                     for r in ledger.samples_by_id(heldout_ids[: cfg.eval.max_eval_samples])],
            regression=(evaluate.load_regression_set(cfg.eval.regression_set, tok, limit=cfg.eval.max_eval_samples,
                                                     max_seq_length=cfg.train.max_seq_length,
                                                     cache_dir=ctx.state / "cache" / "datasets")
                        if cfg.eval.regression_set else []),
            resume=resume)
    ctx.summary.load_info, ctx.summary.step_shape = loaded.info, shape
    return prepared


def evaluate_candidate(ctx: RunContext, prep: Prepared, when: Literal["before", "after"]) -> Measured:
    """Held-out and regression metrics of the model as it is now: the adapter in service before
    training, the candidate after. "before" is measured once per run (kept across attempts)."""
    kept = ctx.checkpoints / "before.json"
    with ctx.phase(Phase.evaluate):
        if when == "before" and kept.exists():
            measured: Measured = json.loads(kept.read_text())
        else:
            kw = {"pad_id": prep.loaded.tokenizer.pad_token_id, "device": prep.loaded.device,
                  "max_tokens_per_batch": ctx.cfg.eval.max_tokens_per_batch}
            measured = {f"heldout_{when}": evaluate.eval_metrics(prep.loaded.model, prep.heldout, **kw),
                        f"regression_{when}": evaluate.eval_metrics(prep.loaded.model, prep.regression, **kw)}
            if when == "before":
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(measured))
    s = ctx.summary
    s.metrics.update(measured)
    for k, m in measured.items():
        setattr(s.losses, k, (m or {}).get("loss"))
    return measured


def train_candidate(ctx: RunContext, prep: Prepared, planned: PlannedRun) -> TrainResult:
    def relay(ev: ChildEvent) -> None:  # progress belongs to this version
        ctx.emit(ev.model_copy(update={"version": planned.version}) if isinstance(ev, ProgressEvent) else ev)

    with ctx.phase(Phase.train):
        result = train(prep.loaded, prep.train_set, ctx.cfg.train, ckpt_root=ctx.checkpoints, deadline=ctx.deadline,
                       stop=ctx.stop, shape=prep.shape, clock=ctx.clock, emit=relay, resume=prep.resume,
                       group=ctx.group)
    s = ctx.summary
    s.trained_samples = sum(1 for i in result.trained_ids if i not in prep.replay_ids)
    s.replay_samples = len(result.trained_ids) - s.trained_samples
    s.trained_tokens, s.steps, s.actual_train_seconds, s.stopped = (result.tokens, result.steps, result.seconds,
                                                                    result.stopped)
    s.losses.train = result.mean_loss
    if result.seconds > 0:
        s.tokens_per_second = result.tokens / result.seconds
        s.samples_per_hour = len(result.trained_ids) * 3600 / result.seconds
    return result
