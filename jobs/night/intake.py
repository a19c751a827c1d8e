"""The night's first steps, without torch: pull what arrived, then plan (or take the stored plan)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import CalibrationRecord, Phase, Plan, PlanEvent, StepShape, version_name
from jobs.data.preview import preview
from jobs.data.pull import PullResult, Quarantine, pull
from jobs.data.quarantine import prune_quarantine
from jobs.data.token_cache import TokenCache
from jobs.learning import plan as budget
from jobs.night.context import RunContext
from jobs.store import learning
from jobs.store.ledger import SampleRow
from jobs.store.paths import StatePaths
from jobs.training.checkpoints import read_state
from jobs.training.fp8.compute import with_compute
from jobs.training.loop_state import LoopState
from jobs.training.shape import history_for_shape, length_curve, resolve_step

log = structlog.get_logger("nightshift.night")


def token_cache(ctx: RunContext, tokenizer: Any) -> TokenCache:
    """Where pull leaves the new samples' token ids for the night's load."""
    return TokenCache(StatePaths(ctx.state).token_cache, tokenizer, max_seq_length=ctx.cfg.train.max_seq_length,
                      overlong=ctx.cfg.train.overlong, special_tokens=ctx.cfg.train.special_tokens)


def start_pull_workers(raw_config: str) -> None:
    """The pull's workers spawn as the night's process starts (rank 0), not after the window opens and
    the imports are done, and check the inbox's large files while it imports (jobs/data/prefetch.py).
    Nothing fails the night here: the pull starts its own workers where these cannot serve it (a tokenizer
    they could not load, another one) and checks what was not checked ahead."""
    from jobs.data.parallel import check_options, start_early
    from jobs.data.prefetch import check_ahead
    from jobs.night.config import NightConfig

    try:
        cfg = NightConfig.model_validate_json(raw_config)
    except Exception as e:  # the night reports its config's errors after the imports
        log.info("pull_workers_not_started_early", error=f"{type(e).__name__}: {e}"[:300])
        return
    model_path = Path(cfg.model.path)
    if not model_path.is_dir():  # a model not there yet (built at the night): the pull's own workers
        log.info("pull_workers_not_started_early", error=f"no model directory at {model_path}")
        return
    try:
        pool = start_early(model_path)
    except Exception as e:
        log.info("pull_workers_not_started_early", error=f"{type(e).__name__}: {e}"[:300])
        return
    if pool is not None:  # [[adapters]]: each adapter's sources, against its own ledger
        for night in [a.night for a in cfg.adapters] or [cfg]:
            t = night.train
            options = check_options(max_seq_length=t.max_seq_length, overlong=t.overlong,
                                    special_tokens=t.special_tokens)
            check_ahead(pool, night.sources, options=options,
                        excerpt_bytes=night.quarantine.excerpt_bytes, now=time.time(),
                        ledger_path=StatePaths(night.state_dir).ledger)


def pull_new_data(ctx: RunContext, tokenizer: Any) -> PullResult:
    """Ingest the inbox; for a plan only read it (nothing ingested, quarantined or moved)."""
    cfg, s = ctx.cfg, ctx.summary
    qfile = StatePaths(ctx.state).quarantine_file(ctx.run_id)
    with ctx.phase(Phase.pull):
        if ctx.plan_only:
            res = preview(cfg.sources, ctx.ledger, tokenizer, max_seq_length=cfg.train.max_seq_length,
                          overlong=cfg.train.overlong, special_tokens=cfg.train.special_tokens,
                          excerpt_bytes=cfg.quarantine.excerpt_bytes)
        else:
            prune_quarantine(qfile.parent, cfg.quarantine.keep_days, now=ctx.clock(), keep=qfile)
            cache = token_cache(ctx, tokenizer)
            try:
                res = pull(cfg.sources, ctx.ledger, tokenizer, run_id=ctx.run_id,
                           quarantine=Quarantine(qfile, excerpt_bytes=cfg.quarantine.excerpt_bytes),
                           max_seq_length=cfg.train.max_seq_length, overlong=cfg.train.overlong,
                           special_tokens=cfg.train.special_tokens, excerpt_bytes=cfg.quarantine.excerpt_bytes,
                           token_cache=cache, stop=ctx.stop)
            finally:
                cache.close()
    s.files_ingested, s.ingested, s.duplicates = res.files, dict(res.ingested), res.duplicates
    s.quarantined = dict(res.quarantined)
    return res


@dataclass(frozen=True)
class PlannedRun:
    plan: Plan
    roles: list[tuple[int, str]]  # (sample id, train | replay | heldout), in training order
    key: str  # the throughput key: calibrate's record and the run's measurement are filed under it
    shape: StepShape  # the step shape, fitted into the memory free at the start of this attempt

    @property
    def version(self) -> int:
        assert self.plan.version is not None
        return self.plan.version

    @property
    def parent(self) -> int | None:
        return self.plan.parent_version


def choose_shape(ctx: RunContext, key: str) -> tuple[StepShape, CalibrationRecord | None]:
    """The step shape from the calibration and the memory free now (every attempt: the server may
    have grown or shrunk since the plan was made)."""
    cal = ctx.measures.calibration(key)
    shape = resolve_step(ctx.cfg.train, cal, free_vram_gb=ctx.free_vram_gb(), max_vram_gb=ctx.cfg.gpu.max_vram_gb,
                         headroom_gb=ctx.cfg.gpu.headroom_gb)
    shape = with_compute(shape, ctx.cfg.train, cal)  # bf16 or FP8 frozen base (issue 16)
    log.info("step_shape", tokens_per_step=shape.tokens_per_step, gradient_checkpointing=shape.gradient_checkpointing,
             compute=shape.compute,
             free_vram_gb=shape.free_vram_gb, limit_gb=shape.limit_gb, predicted_peak_gb=shape.predicted_peak_gb,
             basis=shape.basis)
    return shape, cal


def plan_night(ctx: RunContext, *, key: str, backend: str, device: str,
               incoming: Sequence[SampleRow] = ()) -> PlannedRun:
    """A resumed run keeps the plan it stored (same samples, same version); a new one plans now, with the
    speed of the step shape it will train with. `incoming`: samples not ingested yet (a plan's preview of
    the inbox), newer than every pending one."""
    cfg, ledger = ctx.cfg, ctx.ledger
    with ctx.phase(Phase.plan):
        shape, cal = choose_shape(ctx, key)
        run = ledger.run(ctx.run_id) if ctx.resumed else None
        stored = ledger.plan_of(run) if run is not None else None
        if stored is not None:  # the same samples and version; the time is this attempt's (a new --until)
            left = max(0.0, ctx.deadline - ctx.clock() - stored.overhead_seconds)
            before = trained_before(ctx.checkpoints)
            shown, planned_tokens = budget.resumed_plan(stored, left=left, done_tokens=before.tokens)
            planned = PlannedRun(shown, ledger.run_samples(ctx.run_id), key, shape)
        else:
            pending = ledger.pending(order=cfg.plan.order)
            pending = pending + list(incoming) if cfg.plan.order == "oldest" else [*reversed(incoming), *pending]
            history, note = history_for_shape(ctx.measures.throughput_history(key, cfg.plan.history_runs), shape, cal)
            plan = budget.make_plan(pending, now=ctx.clock(), deadline=ctx.deadline, history=history, cfg=cfg.plan,
                                    epochs=cfg.train.epochs, key=key, replay_pool=learning.replay_pool(ledger),
                                    seed=ctx.night, min_heldout=cfg.eval.min_eval_samples,
                                    checkpoint_every_seconds=cfg.train.checkpoint_every_seconds,
                                    curve=length_curve(cal))
            plan = plan.model_copy(update={"version": ledger.next_version(),
                                           "parent_version": ctx.parent,
                                           "backend": backend, "device": device, "step_shape": shape,
                                           "basis": f"{plan.basis}; {note}" if plan.measured else plan.basis})
            planned = PlannedRun(plan, plan.roles(), key, shape)
            if not ctx.plan_only and plan.train_ids:
                ledger.save_plan(ctx.run_id, plan, planned.roles, version_name(cfg.model.name, planned.version))
        p = planned.plan
        ctx.emit(PlanEvent(plan=p))
        log.info("plan", samples=len(p.train_ids), tokens=p.train_tokens, heldout=len(p.heldout_ids),
                 deferred=p.deferred_samples, predicted_train_seconds=round(p.predicted_train_seconds, 1),
                 basis=p.basis)
    s = ctx.summary
    s.plan, s.plan_basis, s.predicted_train_seconds = p, p.basis, p.predicted_train_seconds
    s.planned_tokens, s.step_shape = p.train_tokens * p.epochs, planned.shape
    s.deferred_samples, s.parent_version, s.heldout_samples = p.deferred_samples, p.parent_version, len(p.heldout_ids)
    if stored is not None:  # a resume: the night's tokens and seconds as planned now, the attempts before included;
        s.planned_tokens, s.deferred_samples = planned_tokens, stored.deferred_samples  # cuts: counted by the loop
        s.predicted_train_seconds = before.seconds + p.predicted_train_seconds
    return planned


def trained_before(ckpt_root: Path) -> LoopState:
    """What the attempts before this one trained (the newest checkpoint's count; none: nothing), for the plan's
    figures only: the checkpoint is checked before it is resumed from (jobs/night/candidate.py)."""
    for name in ("latest", "previous"):
        try:
            return read_state(ckpt_root / name)
        except (OSError, ValueError):
            continue
    return LoopState(next_batch=0, steps=0)
