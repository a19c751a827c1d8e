"""A night of several adapters ([[adapters]]) on one resident base model.

    pull every adapter -> plan the window over them -> for each in turn: plan, load, train, gate, publish

Each adapter's steps are today's (jobs/night/run.py) on its own state directory, inside its own slice of
the window (jobs/night/several/share.py); each is guarded on its own: one adapter's bad data, rejection or
exception is its outcome, recorded in its ledger, and the next one goes on. The night's own run lives in
the top state directory's ledger (the supervisor retries and closes it as it does a night of one adapter);
a retry resumes each adapter's open run from its checkpoint and skips the adapters whose night is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from jobs.contract import AdapterShare, ChildEvent, Emit, Outcome, ResultEvent, RunSummary, SharesEvent, new_run_id
from jobs.contract.calibration import CalibrationRecord
from jobs.contract.crashpoints import declare, reached
from jobs.data.parallel import close_early
from jobs.learning import plan as budget
from jobs.night.config import AdapterNight, NightConfig
from jobs.night.context import RunContext, open_context
from jobs.night.model import model_fingerprint, night_model
from jobs.night.run import Pulled, close_context, failure_text, pull_step, record_failure, run_key, train_step
from jobs.night.several.share import slice_ends, water_fill
from jobs.store.cleanup import close_run
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from jobs.store.stale import close_expired_runs
from jobs.training import resident
from jobs.training.ranks.collectives import SOLO, Solo

log = structlog.get_logger("nightshift.night")
ADAPTER_DONE = declare("night.adapter_done", "one adapter of a night of several has closed its run; the next "
                       "has not started training")


@dataclass
class _Going:
    """An adapter whose pull is done and whose training is ahead."""

    spec: AdapterNight
    ctx: RunContext
    pulled: Pulled


def run_adapters(cfg: NightConfig, *, night: str, deadline: float, emit: Emit, stop: threading.Event,
                 clock: Callable[[], float] = time.time, plan_only: bool = False, run_id: str | None = None,
                 process_started: float | None = None, group: Solo = SOLO) -> RunSummary:
    """The night of every adapter of `cfg.adapters`; the summary lists each one's (`adapters`) and the plan
    that shared the window (`shares`). Arguments as jobs.night.run.run_night's."""
    with night_model(cfg, plan_only=plan_only) as model_path:
        return _night(cfg, model_path, night=night, deadline=deadline, emit=emit, stop=stop, clock=clock,
                      plan_only=plan_only, run_id=run_id, process_started=process_started, group=group)


def _night(cfg: NightConfig, model_path: Path, *, night: str, deadline: float, emit: Emit, stop: threading.Event,
           clock: Callable[[], float], plan_only: bool, run_id: str | None, process_started: float | None,
           group: Solo) -> RunSummary:
    if group.world > 1:
        raise ValueError("[[adapters]] with a night of several processes ([train] gpus > 1) is not supported yet: "
                         "train the adapters on one card")
    resident.enable(not plan_only)  # the base stays loaded from one adapter to the next
    top = StatePaths(cfg.state_dir)
    top.root.mkdir(parents=True, exist_ok=True)
    ledger = open_read_only(top.ledger, clock=clock) if plan_only else Ledger(top.ledger, clock=clock)
    try:
        run_id, resumed_since = _open_night(ledger, night, deadline, run_id, clock, plan_only)
        summary = RunSummary(run_id=run_id, night=night, deadline=deadline, started_at=clock(),
                             base_model=str(model_path))
        fingerprint = model_fingerprint(model_path)
        done: dict[str, RunSummary] = {}
        going: list[_Going] = []
        for spec in cfg.adapters:  # every adapter's pull first: the plan over them needs what each has
            finished = None if resumed_since is None else _finished_tonight(spec.night, night, resumed_since)
            if finished is not None:  # a retry of this night: this adapter's is done, never trained twice
                done[spec.name] = finished
                continue
            got = _pull(spec, model_path, fingerprint, night=night, deadline=deadline, emit=emit, stop=stop,
                        clock=clock, plan_only=plan_only, process_started=process_started, group=group)
            if isinstance(got, RunSummary):
                done[spec.name] = got
            else:
                going.append(got)
        close_early()  # the workers that checked the adapters' files ahead (jobs/data/parallel.py: pull_done)
        shares = plan_shares(going, start=clock(), deadline=deadline)
        summary.shares = shares
        emit(SharesEvent(shares=shares))
        log.info("adapters_plan", adapters=[{"adapter": s.adapter, "pending_tokens": s.pending_tokens,
                                             "tokens_per_second": s.tokens_per_second, "weight": s.weight,
                                             "min_share": s.min_share, "seconds": round(s.seconds, 1),
                                             "share": round(s.share, 3)} for s in shares])
        for g, end in zip(going, slice_ends(clock(), deadline, shares), strict=True):
            done[g.spec.name] = _train(g, end, stop)
            reached(ADAPTER_DONE)
        summary.adapters = [done[spec.name] for spec in cfg.adapters]
        summary.outcome, summary.error = night_outcome(summary.adapters)
        summary.ended_at = clock()
        summary.trained_samples = sum(s.trained_samples for s in summary.adapters)
        summary.trained_tokens = sum(s.trained_tokens for s in summary.adapters)
        if not plan_only:
            _close_night(ledger, summary)
        return summary
    finally:
        resident.enable(False)
        ledger.close()


def _open_night(ledger: Ledger, night: str, deadline: float, run_id: str | None, clock: Callable[[], float],
                plan_only: bool) -> tuple[str, float | None]:
    """The night's own run in the top ledger (a retry reopens it): what the supervisor retries and closes.
    Returns its id and, for a retry, when its first attempt started (adapters done since are not run again;
    a new run, a second `once` of the night, trains what came since like a night of one adapter does)."""
    if plan_only:
        return run_id or new_run_id("plan"), None
    close_expired_runs(ledger, clock())
    open_run = ledger.open_run(night)
    if open_run is not None:
        attempt = ledger.resume_run(str(open_run["id"]), deadline)
        ledger.add_event("resumed", run_id=str(open_run["id"]), detail={"attempt": attempt, "deadline": deadline})
        return str(open_run["id"]), float(open_run["started_at"])
    run_id = run_id or new_run_id(night)
    ledger.start_run(run_id, night, deadline)
    return run_id, None


def _close_night(ledger: Ledger, summary: RunSummary) -> None:
    """A night some adapter failed (or was stopped in) stays open: the supervisor retries it, and the retry
    resumes that adapter only."""
    if summary.outcome in (Outcome.failed, Outcome.interrupted):
        if summary.outcome is Outcome.failed:
            ledger.add_event("attempt_failed", run_id=summary.run_id,
                             detail={"night": summary.night, "error": summary.error})
        ledger.store_summary(summary.run_id, summary)
    else:
        close_run(ledger, summary.run_id, summary.outcome.value, summary=summary, error=summary.error)


def _finished_tonight(cfg: NightConfig, night: str, since: float) -> RunSummary | None:
    """This adapter's run of `night` closed since `since` (its summary), if none of its runs is open."""
    path = StatePaths(cfg.state_dir).ledger
    if not path.is_file():
        return None
    ledger = open_read_only(path)
    try:
        if ledger.open_run(night) is not None or not ledger.night_done(night):
            return None
        row = ledger.db.execute("SELECT * FROM runs WHERE night=? AND status!='running' AND started_at>=? "
                                "ORDER BY started_at DESC LIMIT 1", (night, since)).fetchone()
        if row is None:
            return None
        summary = ledger.summary_of(row) or RunSummary(run_id=str(row["id"]), night=night)
        return summary.model_copy(update={"outcome": Outcome(row["status"])})
    finally:
        ledger.close()


def _pull(spec: AdapterNight, model_path: Path, fingerprint: str, *, night: str, deadline: float, emit: Emit,
          stop: threading.Event, clock: Callable[[], float], plan_only: bool, process_started: float | None,
          group: Solo) -> _Going | RunSummary:
    """Open this adapter's run and pull its sources; a failure (or a stop) ends its night here, alone."""
    def tagged(ev: ChildEvent) -> None:
        emit(ev.model_copy(update={"adapter": spec.name}))

    try:
        ctx = open_context(spec.night, model_path=model_path, fingerprint=fingerprint, night=night, deadline=deadline,
                           emit=tagged, stop=stop, clock=clock, plan_only=plan_only, process_started=process_started,
                           group=group)
    except Exception as e:  # its ledger cannot be opened: its night fails, the others go on
        log.error("adapter_failed", adapter=spec.name, error=failure_text(e))
        return RunSummary(night=night, adapter=spec.name, outcome=Outcome.failed, error=failure_text(e))
    ctx.summary.adapter, ctx.summary.ranks = spec.name, group.world
    try:
        pulled = pull_step(ctx)
    except Exception as e:
        record_failure(ctx, e)
        pulled = None
    if pulled is None:
        close_context(ctx)
        return ctx.summary
    return _Going(spec, ctx, pulled)


def plan_shares(going: list[_Going], *, start: float, deadline: float) -> list[AdapterShare]:
    """Each adapter's slice of what is left of the window: its pending tokens at its measured rate."""
    shares, keys_before = [], set()
    for g in going:
        cfg, ledger = g.ctx.cfg, g.ctx.ledger
        key = run_key(g.ctx, g.pulled)
        samples, tokens = ledger.backlog()
        incoming = g.pulled.result.incoming  # a plan's preview: not ingested yet
        samples, tokens = samples + len(incoming), tokens + sum(r.n_tokens for r in incoming)
        tokens *= cfg.train.epochs
        if ledger.replay_pool():  # replayed samples take their share of the training tokens
            tokens = int(tokens / (1 - cfg.plan.replay_share))
        history = g.ctx.measures.throughput_history(key, cfg.plan.history_runs)
        tps, overhead, basis, _ = budget.estimate(history, cfg.plan)
        if key in keys_before and tokens:
            overhead = later_overhead(overhead, history, g.ctx.measures.calibration(key))
        keys_before.add(key)
        demand = tokens / (tps * cfg.plan.safety_factor)  # training time; its overhead comes first (share.py)
        shares.append(AdapterShare(adapter=g.spec.name, weight=g.spec.weight, min_share=g.spec.min_share,
                                   pending_samples=samples, pending_tokens=tokens, tokens_per_second=tps,
                                   overhead_seconds=overhead, key=key, basis=basis, demand_seconds=demand))
    return water_fill(deadline - start, shares)


def later_overhead(overhead: float, history: list, cal: CalibrationRecord | None) -> float:
    """An adapter after another of the same base: planned from calibrate alone, its overhead without the base's
    load, which calibrate measured once with the cache of the quantised base still to build (42.1 of an 8B's 45.5 s,
    where the night's loads took 5–7 s): four times that starved the first adapter of a 4-min window on an H200,
    RESULTS.md: 2026-11-28, four adapters vs one (H200). Once a night has measured itself, its own figure."""
    if cal is None or not history or any(r["origin"] != "calibrate" for r in history):
        return overhead
    return max(0.0, overhead - cal.overhead_detail.get("load", 0.0))


def _train(g: _Going, end: float, stop: threading.Event) -> RunSummary:
    """One adapter's steps after the pull, until `end` (its slice's deadline); whatever happens, its own."""
    ctx = g.ctx
    ctx.deadline = ctx.summary.deadline = end
    try:
        if stop.is_set():  # stopped before its turn: its run stays open, resumed by the next start
            ctx.summary.outcome = Outcome.interrupted
            return ctx.summary
        if not ctx.plan_only:
            ctx.start_gpu()
        train_step(ctx, g.pulled)
    except Exception as e:
        record_failure(ctx, e)
    finally:
        close_context(ctx)
        resident.release()
    if not ctx.plan_only:
        ctx.emit(ResultEvent(summary=ctx.summary))  # the supervisor's per-adapter figures (tagged)
    log.info("adapter_done", adapter=g.spec.name, outcome=ctx.summary.outcome.value, version=ctx.summary.version_name,
             error=ctx.summary.error)
    return ctx.summary


def night_outcome(results: list[RunSummary]) -> tuple[Outcome, str | None]:
    """The night's outcome from its adapters': interrupted or failed if any was (the supervisor retries or
    closes it), else succeeded if any was, else rejected if any was, else skipped; the error names each
    adapter that did not succeed."""
    outcomes = {r.outcome for r in results}
    order = (Outcome.interrupted, Outcome.failed, Outcome.succeeded, Outcome.rejected, Outcome.skipped)
    outcome = next((o for o in order if o in outcomes), Outcome.skipped)
    errors = [f"{r.adapter}: {r.outcome.value}" + (f" ({r.error})" if r.error else "")
              for r in results if r.outcome in (Outcome.failed, Outcome.interrupted, Outcome.rejected)]
    return outcome, "; ".join(errors) or None
