"""The torch steps of a night: load the model and the night's data, evaluate, train the candidate.

Kept apart from intake (pull, plan) so that those never import torch. A run killed while
training resumes from its last checkpoint; what its first attempt decided before training (the
reference, what is measured after) is kept next to the checkpoints, so the candidate is always judged
against the adapter it started from (what is measured, under which models: jobs/night/measure.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from jobs.contract import ChildEvent, EvalMetrics, Phase, ProgressEvent, StepShape
from jobs.data.batching import TokenizedSample
from jobs.data.token_cache import tokenizer_identity
from jobs.night import lineage
from jobs.night.background import in_background
from jobs.night.context import RunContext
from jobs.night.intake import PlannedRun, token_cache
from jobs.night.measure import EvalSets, build_sets, kept_before, measure_all, score_cache
from jobs.night.preference import reference_kept
from jobs.store.integrity import verified
from jobs.store.paths import StatePaths
from jobs.training.checkpoints import latest_checkpoint
from jobs.training.load import Loaded, load_for_training
from jobs.training.loop import TrainResult, train
from jobs.training.moe.lora import ExpertLoraError, watch_experts

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
    sets: EvalSets  # held-out and regression samples, the reference version
    resume: Path | None  # the checkpoint this attempt continues from
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)  # regression slice -> stage -> metrics


def load_model_and_data(ctx: RunContext, planned: PlannedRun, tokenizer: Any) -> Prepared:
    """`tokenizer`: the one pull tokenised with (the base's own files); the night's token ids are read back
    with it while the model loads, and read again only where the loader's tokenizer is another."""
    cfg, ledger = ctx.cfg, ctx.ledger
    parent_path = (verified(ctx.registry, ledger, planned.parent, role="parent adapter")  # sha256 checked
                   if planned.parent else None)
    # a checkpoint continues only where the attempt before it kept what it is judged against: else start over
    resume = latest_checkpoint(ctx.checkpoints) if kept_before(ctx) is not None and reference_kept(ctx) else None
    shape = planned.shape  # chosen at plan time from the memory free then (jobs/night/intake.py)
    import torch

    cuda = torch.cuda.is_available()
    ctx.summary.method = cfg.train.method.on(cuda)  # a CPU night's "qlora" quantises nothing: it is lora
    lineage.check_parent(ledger, cfg.train, planned.parent, cuda=cuda)  # refused before anything is loaded
    lineage.check_checkpoint(ctx.checkpoints, ctx.summary.method, resuming=resume is not None)
    train_ids = [sid for sid, role in planned.roles if role in ("train", "replay")]
    heldout_ids = [sid for sid, role in planned.roles if role == "heldout"]
    new_ids = {sid for sid, role in planned.roles if role == "train"}
    with ctx.phase(Phase.load):
        # the ids in a thread, the model here, in the thread that trains, as it always loaded (another thread was
        # measured not to slow the first step's compile: RESULTS.md: 2026-11-26, wake restart)
        with in_background(_train_set, ctx, tokenizer, train_ids) as reading:
            loaded = load_for_training(ctx.model_path, cfg.train, adapter=resume or parent_path, shape=shape,
                                       cache_dir=StatePaths(ctx.shared).models, max_vram_gb=cfg.gpu.max_vram_gb)
        train_set = reading.result()
        tok = loaded.tokenizer
        if _identity(ctx, tok) != _identity(ctx, tokenizer):  # the loader's tokenizer is another: its own ids
            log.info("tokens_reread", why="the loaded model's tokenizer differs from the base's")
            train_set = _train_set(ctx, tok, train_ids)
        prepared = Prepared(
            loaded=loaded, shape=shape,
            train_set=train_set,
            replay_ids={sid for sid, role in planned.roles if role == "replay"},
            heldout_ids=heldout_ids, resume=resume,
            sets=build_sets(ctx, tok, heldout_ids, planned.parent, score_cache(ctx, loaded, shape.compute),
                            new_samples=[x for x in train_set if x.sample_id in new_ids]))
    ctx.summary.load_info, ctx.summary.step_shape = loaded.info, shape
    return prepared


def _train_set(ctx: RunContext, tokenizer: Any, ids: list[int]) -> list[TokenizedSample]:
    """Pull left the ids in the token cache: no second tokenisation of the night's data."""
    cache = token_cache(ctx, tokenizer)
    try:
        return cache.samples(ctx.ledger.sample_hashes(ids), ctx.ledger.samples_by_id)
    finally:
        cache.close()


def _identity(ctx: RunContext, tokenizer: Any) -> str:
    t = ctx.cfg.train
    return tokenizer_identity(tokenizer, t.max_seq_length, t.overlong, t.special_tokens)


def evaluate_candidate(ctx: RunContext, prep: Prepared, when: Literal["before", "after"]) -> Measured:
    """Held-out and regression metrics. Before training: what the candidate is compared with, decided once
    per run and kept across attempts (for an adapter nothing is scored yet). After: the candidate, the base,
    the adapter in service and the reference (jobs/night/measure.py)."""
    with ctx.phase(Phase.evaluate):
        measured, slices = measure_all(ctx, prep.loaded, prep.sets, when)
    for name, stages in slices.items():
        prep.slices.setdefault(name, {}).update(stages)
    s = ctx.summary
    s.metrics.update(measured)
    for k, m in measured.items():
        if k.endswith(("_before", "_after")) and k.startswith(("heldout_", "regression_")):  # Losses' fields
            setattr(s.losses, k, (m or {}).get("loss"))
    return measured



def train_candidate(ctx: RunContext, prep: Prepared, planned: PlannedRun) -> TrainResult:
    def relay(ev: ChildEvent) -> None:  # progress belongs to this version
        ctx.emit(ev.model_copy(update={"version": planned.version}) if isinstance(ev, ProgressEvent) else ev)

    if ctx.cfg.train.objective == "dpo":  # preference pairs against the version in service
        from jobs.night.preference import train_pairs

        return train_pairs(ctx, prep, relay)
    s = ctx.summary
    try:  # issue 15: every expert LoRA tensor of a MoE base must get a gradient and move, or the night fails
        watch = watch_experts(prep.loaded.model, ctx.cfg.train.target_modules)
        with ctx.phase(Phase.train):
            result = train(prep.loaded, prep.train_set, ctx.cfg.train, ckpt_root=ctx.checkpoints,
                           deadline=ctx.deadline, stop=ctx.stop, shape=prep.shape, clock=ctx.clock, emit=relay,
                           resume=prep.resume, probe_first=not planned.plan.measured,
                           group=ctx.group)
        if watch is not None:
            s.expert_lora = watch.finish(check_moved=result.stopped != "signal" and result.steps > 0)
            result.detail.expert_lora = s.expert_lora
    except ExpertLoraError as e:
        s.expert_lora = e.report
        fail_expert_check(ctx, e)
        raise
    if result.detail.step_shape is not None:  # as trained (a probe may resize it)
        s.step_shape = result.detail.step_shape
    if result.first_step_at is not None and ctx.process_started is not None:
        s.first_step_seconds = result.first_step_at - ctx.process_started
    s.trained_samples = sum(1 for i in result.trained_ids if i not in prep.replay_ids)
    s.replay_samples = len(result.trained_ids) - s.trained_samples
    if result.stopped != "signal":  # stopped on request the samples stay tonight's: the next start resumes them
        s.cut_samples = sum(1 for i in result.cut_ids + result.partial_ids if i not in prep.replay_ids)
        s.deferred_samples = (s.deferred_samples or 0) + s.cut_samples
    s.trained_tokens, s.steps, s.actual_train_seconds, s.stopped = (result.tokens, result.steps, result.seconds,
                                                                    result.stopped)
    s.losses.train = result.mean_loss
    if result.seconds > 0:
        s.tokens_per_second = result.tokens / result.seconds
        s.samples_per_hour = len(result.trained_ids) * 3600 / result.seconds
    return result


def fail_expert_check(ctx: RunContext, e: ExpertLoraError) -> None:
    """Close the run as failed at once: a retry would train the same broken expert path again. Nothing is
    published; the samples stay pending for a night whose stack trains the experts."""
    import shutil

    log.error("expert_lora_check_failed", error=str(e), report=e.report.model_dump() if e.report else None)
    ctx.finish("failed", str(e))
    shutil.rmtree(ctx.checkpoints, ignore_errors=True)
