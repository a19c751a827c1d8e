"""One night, as a flat sequence of steps over one run context:

    pull -> plan -> load -> evaluate before -> train -> evaluate after -> gate -> publish -> announce

Runs in the child process (jobs/night/child.py), reports through typed events and returns the
RunSummary. Every step is idempotent against the ledger: a rerun of the same night resumes the
open run with its stored plan, from its last checkpoint, and trains nothing twice.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import Emit, Outcome, RunSummary, version_name
from jobs.data.pull import PullResult
from jobs.night.candidate import evaluate_candidate, load_model_and_data, train_candidate
from jobs.night.config import NightConfig
from jobs.night.context import RunContext, open_context
from jobs.night.intake import plan_night, pull_new_data
from jobs.night.isolate import rescore_held
from jobs.night.measure import keep_candidate_scores
from jobs.night.model import model_fingerprint, night_model, throughput_key
from jobs.night.preference import judge_preferences
from jobs.night.publish import announce_version, close_run, finish_published, judge, publish_candidate
from jobs.night.ranks import share_prepared
from jobs.night.shadow import check_through_server
from jobs.store.files import DamagedState
from jobs.store.integrity import check_registry_known, parent_for_night
from jobs.training.ranks.collectives import SOLO, Solo
from jobs.training.ranks.topology import night_size

log = structlog.get_logger("nightshift.night")


def run_night(cfg: NightConfig, *, night: str, deadline: float, emit: Emit, stop: threading.Event,
              clock: Callable[[], float] = time.time, plan_only: bool = False, run_id: str | None = None,
              process_started: float | None = None, group: Solo = SOLO) -> RunSummary:
    """`plan_only`: pull and plan without changing anything (no ingest, no quarantine file, no move,
    no model built in the state directory). `run_id`: the id the supervisor logs under (a new run only).
    `process_started`: when the child process started (the summary's wake -> first step).
    `group`: the night's ranks (this process is rank 0; one process: SOLO)."""
    with night_model(cfg, plan_only=plan_only) as model_path:
        return _run(cfg, model_path, night=night, deadline=deadline, emit=emit, stop=stop, clock=clock,
                    plan_only=plan_only, run_id=run_id, process_started=process_started, group=group)


def _run(cfg: NightConfig, model_path: Path, *, night: str, deadline: float, emit: Emit, stop: threading.Event,
         clock: Callable[[], float], plan_only: bool, run_id: str | None, process_started: float | None,
         group: Solo) -> RunSummary:
    ctx = open_context(cfg, model_path=model_path, fingerprint=model_fingerprint(model_path), night=night,
                       deadline=deadline, emit=emit, stop=stop, clock=clock, plan_only=plan_only, run_id=run_id,
                       process_started=process_started, group=group)
    ctx.summary.ranks = group.world  # [distributed]
    if not plan_only:
        ctx.start_gpu()
    try:
        _steps(ctx)
    except Exception as e:
        record_failure(ctx, e)
    finally:
        close_context(ctx)
    return ctx.summary


def record_failure(ctx: RunContext, e: Exception) -> None:
    """The run stays open: its supervisor retries (resuming from the last checkpoint) or closes it as
    failed once the attempts or the window are used up."""
    ctx.summary.outcome, ctx.summary.error = Outcome.failed, failure_text(e)
    if isinstance(e, DamagedState | OSError | sqlite3.OperationalError):  # the operator's to fix: no traceback
        log.error("run_failed", error=ctx.summary.error)
    else:
        log.exception("run_failed", error=ctx.summary.error)
    if not ctx.plan_only:
        ctx.ledger.add_event("attempt_failed", run_id=ctx.run_id,
                             detail={"night": ctx.night, "error": ctx.summary.error})


def close_context(ctx: RunContext) -> None:
    """The run's figures into its summary and the ledger (which is closed)."""
    ctx.stop_gpu()
    ctx.summary.ended_at = ctx.clock()
    ctx.summary.backlog_samples, ctx.summary.backlog_tokens = ctx.ledger.backlog()
    if not ctx.plan_only:
        ctx.ledger.store_summary(ctx.run_id, ctx.summary)
    ctx.ledger.close()
    ctx.close_measures()


@dataclass
class Pulled:
    """What a run has before it plans: the base's tokenizer, the backend, and what the pull ingested."""

    tokenizer: Any
    backend: str
    device: str
    result: PullResult


def _steps(ctx: RunContext) -> None:
    from jobs.data.parallel import close_early

    try:
        pulled = pull_step(ctx)
    finally:
        close_early()  # the night's one pull is over
    if pulled is not None:
        train_step(ctx, pulled)


def pull_step(ctx: RunContext) -> Pulled | None:
    """The registry checked, the inbox pulled. None: the run ended here (a stop during the pull)."""
    from jobs.training.load import device_name, load_tokenizer, resolve_backend

    s = ctx.summary
    check_registry_known(ctx.registry, ctx.ledger, ctx.cfg.model.name)  # refused: a ledger behind the registry
    ctx.parent = parent_for_night(ctx.registry, ctx.ledger, repair=not ctx.plan_only)  # refused: damaged lineage
    backend, device = resolve_backend(ctx.cfg.train), device_name()
    tokenizer = load_tokenizer(ctx.model_path)
    pulled = pull_new_data(ctx, tokenizer)
    if pulled.stopped:  # a stop request during the pull: what was ingested is kept, nothing is planned
        s.outcome = Outcome.interrupted
        log.info("run_interrupted", during="pull", files=pulled.files)
        return None
    return Pulled(tokenizer, backend, device, pulled)


def run_key(ctx: RunContext, pulled: Pulled) -> str:
    """The throughput key this run plans with and files its measurement under."""
    ranks = ctx.group.world if not ctx.plan_only else night_size(ctx.cfg.train)  # a plan runs alone
    return throughput_key(ctx.cfg, ctx.fingerprint, pulled.backend, pulled.device, gpus=ranks)  # measured per count


def train_step(ctx: RunContext, pulled: Pulled) -> None:
    """Plan (within `ctx.deadline`), load, evaluate, train, gate, publish, announce."""
    s, tokenizer = ctx.summary, pulled.tokenizer
    planned = plan_night(ctx, key=run_key(ctx, pulled), backend=pulled.backend, device=pulled.device,
                         incoming=pulled.result.incoming)
    if ctx.plan_only:
        s.outcome = Outcome.skipped
        return
    if not planned.plan.train_ids:
        ctx.finish("skipped", "nothing to train: no pending samples fit" if planned.plan.deferred_samples
                   else "no new samples")
        return
    s.version, s.version_name = planned.version, version_name(ctx.cfg.model.name, planned.version)
    row = ctx.ledger.version(planned.version)
    if row is not None and row["status"] in ("promoted", "rejected"):
        finish_published(ctx, row)
        return
    prep = load_model_and_data(ctx, planned, tokenizer)
    share_prepared(ctx, prep, planned)  # [distributed] the other ranks get their night (a no-op for one)
    evaluate_candidate(ctx, prep, "before")
    result = train_candidate(ctx, prep, planned)
    if result.stopped == "signal":
        s.outcome = Outcome.interrupted  # the run stays open: the next start resumes from the checkpoint
        ctx.ledger.add_event("interrupted", run_id=ctx.run_id,  # the report shows it (not one plain "succeeded")
                             detail={"next_batch": result.detail.batches_done, "of": result.detail.batches})
        log.info("run_interrupted", next_batch=result.detail.batches_done, of=result.detail.batches)
        return
    if s.trained_samples == 0:
        ctx.finish("skipped", "the deadline left no time for a single step")
        return
    evaluate_candidate(ctx, prep, "after")
    verdict = judge_preferences(judge(ctx, prep), result)
    if verdict.passed:  # [hotswap.shadow]: the server must answer as the candidate did in process
        check_through_server(ctx, prep, planned.version, verdict)
    published = publish_candidate(ctx, prep, planned, result, verdict)
    if published.promoted:
        keep_candidate_scores(ctx, prep.sets, published.version)
        rescore_held(ctx, prep.loaded, prep.sets, [x for x in prep.train_set if x.sample_id not in prep.replay_ids],
                     published.version)
        announce_version(ctx, published.version, published.path)
    close_run(ctx, planned, result, published)


def failure_text(e: BaseException) -> str:
    """One line for the summary and the CLI: a damaged state's own message, else type and message."""
    if isinstance(e, DamagedState):
        return f"damaged state: {e}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"
