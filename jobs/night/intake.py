"""The night's first steps, without torch: pull what arrived, then plan (or take the stored plan)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from jobs import plan as budget
from jobs.contract import Phase, Plan, PlanEvent, version_name
from jobs.data.preview import preview
from jobs.data.pull import PullResult, Quarantine, pull
from jobs.data.quarantine import prune_quarantine
from jobs.night.context import RunContext
from jobs.store import learning
from jobs.store.ledger import SampleRow

log = structlog.get_logger("nightshift.night")


def pull_new_data(ctx: RunContext, tokenizer: Any) -> PullResult:
    """Ingest the inbox; for a plan only read it (nothing ingested, quarantined or moved)."""
    cfg, s = ctx.cfg, ctx.summary
    qfile = ctx.state / "quarantine" / f"{ctx.run_id}.jsonl"
    with ctx.phase(Phase.pull):
        if ctx.plan_only:
            res = preview(cfg.sources, ctx.ledger, tokenizer, max_seq_length=cfg.train.max_seq_length,
                          overlong=cfg.train.overlong, special_tokens=cfg.train.special_tokens,
                          excerpt_bytes=cfg.quarantine.excerpt_bytes)
        else:
            prune_quarantine(qfile.parent, cfg.quarantine.keep_days, now=ctx.clock(), keep=qfile)
            res = pull(cfg.sources, ctx.ledger, tokenizer, run_id=ctx.run_id,
                       quarantine=Quarantine(qfile, excerpt_bytes=cfg.quarantine.excerpt_bytes),
                       max_seq_length=cfg.train.max_seq_length, overlong=cfg.train.overlong,
                       special_tokens=cfg.train.special_tokens, excerpt_bytes=cfg.quarantine.excerpt_bytes)
    s.files_ingested, s.ingested, s.duplicates = res.files, dict(res.ingested), res.duplicates
    s.quarantined = dict(res.quarantined)
    return res


@dataclass(frozen=True)
class PlannedRun:
    plan: Plan
    roles: list[tuple[int, str]]  # (sample id, train | replay | heldout), in training order
    key: str  # the throughput key: calibrate's record and the run's measurement are filed under it

    @property
    def version(self) -> int:
        assert self.plan.version is not None
        return self.plan.version

    @property
    def parent(self) -> int | None:
        return self.plan.parent_version


def plan_night(ctx: RunContext, *, key: str, backend: str, device: str,
               incoming: Sequence[SampleRow] = ()) -> PlannedRun:
    """A resumed run keeps the plan it stored (same samples, same version); a new one plans now.
    `incoming`: samples not ingested yet (a plan's preview of the inbox), newer than every pending one."""
    cfg, ledger = ctx.cfg, ctx.ledger
    with ctx.phase(Phase.plan):
        run = ledger.run(ctx.run_id) if ctx.resumed else None
        stored = ledger.plan_of(run) if run is not None else None
        if stored is not None:
            planned = PlannedRun(stored, ledger.run_samples(ctx.run_id), key)
        else:
            pending = ledger.pending(order=cfg.plan.order)
            pending = pending + list(incoming) if cfg.plan.order == "oldest" else [*reversed(incoming), *pending]
            plan = budget.make_plan(pending, now=ctx.clock(), deadline=ctx.deadline,
                                    history=ledger.throughput_history(key, cfg.plan.history_runs), cfg=cfg.plan,
                                    epochs=cfg.train.epochs, key=key, replay_pool=learning.replay_pool(ledger),
                                    seed=ctx.night, min_heldout=cfg.eval.min_eval_samples)
            plan = plan.model_copy(update={"version": ledger.next_version(),
                                           "parent_version": ctx.parent,
                                           "backend": backend, "device": device})
            planned = PlannedRun(plan, plan.roles(), key)
            if not ctx.plan_only and plan.train_ids:
                ledger.save_plan(ctx.run_id, plan, planned.roles, version_name(cfg.model.name, planned.version))
        p = planned.plan
        ctx.emit(PlanEvent(plan=p))
        log.info("plan", samples=len(p.train_ids), tokens=p.train_tokens, heldout=len(p.heldout_ids),
                 deferred=p.deferred_samples, predicted_train_seconds=round(p.predicted_train_seconds, 1),
                 basis=p.basis)
    s = ctx.summary
    s.plan, s.plan_basis, s.predicted_train_seconds = p, p.basis, p.predicted_train_seconds
    s.deferred_samples, s.parent_version, s.heldout_samples = p.deferred_samples, p.parent_version, len(p.heldout_ids)
    return planned
