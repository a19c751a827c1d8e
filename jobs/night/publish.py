"""The night's last steps: judge the candidate, publish it as an immutable version, announce it.

A promoted night's samples are marked trained and its held-out samples join the regression set;
the candidate becomes the gate's reference when it is at least as good as the reference was. A
rejected night's samples were never learned by the adapter in service: they go back to pending
(or to 'rejected'), counted, and a sample rejected too often is set aside with its reasons; none
of them is ever replayed. Both keep the night's loss curve (ledger, manifest `loss_curve`).

Crash safety:
- killed after the version directory was renamed but before the ledger recorded it: that
  directory was never recorded nor served, so it is replaced on the rerun;
- killed after the ledger recorded the version: the rerun only finishes the job (moves
  `current` if promoted, announces it if no target heard of it) and trains nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import (
    GateResult,
    HotswapEvent,
    HotswapOutcome,
    Losses,
    Phase,
    Plan,
    nightshift_version,
    version_name,
)
from jobs.contract.crashpoints import declare, reached
from jobs.gpu.telemetry import energy_fields
from jobs.hotswap.versions import announce
from jobs.learning import gate
from jobs.night import isolate
from jobs.night.candidate import Prepared
from jobs.night.context import RunContext
from jobs.night.intake import PlannedRun
from jobs.night.lineage import method_of
from jobs.store import file_strikes, learning
from jobs.store.files import DamagedState
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths
from jobs.training.loop import TrainResult
from jobs.training.save import save_version

log = structlog.get_logger("nightshift.night")
VERSION_RECORDED = declare("publish.version_recorded",
                           "the ledger holds the version, its samples trained; `current` not moved yet")


def judge(ctx: RunContext, prep: Prepared | None = None) -> GateResult:
    verdict = gate.gate(ctx.summary.losses, ctx.cfg.eval, ctx.summary.metrics,
                        not_evaluated=ctx.summary.not_evaluated,
                        per_sample=prep.sets.per_sample if prep is not None else None,
                        slices=prep.sets.slices if prep is not None else None)
    ref = prep.sets.reference if prep is not None else None
    verdict.reference_version = ref
    verdict.reference = f"v{ref} (the best promoted version so far)" if ref else "the base model (none promoted yet)"
    log.info("gate", passed=verdict.passed, checks=[c.model_dump() for c in verdict.checks])
    ctx.summary.gate = verdict
    return verdict


@dataclass(frozen=True)
class Published:
    version: int
    path: Path
    promoted: bool


def publish_candidate(ctx: RunContext, prep: Prepared, planned: PlannedRun, result: TrainResult,
                      verdict: GateResult) -> Published:
    cfg, ledger, registry, s = ctx.cfg, ctx.ledger, ctx.registry, ctx.summary
    new_ids = [i for i in result.trained_ids if i not in prep.replay_ids]
    replayed = [i for i in result.trained_ids if i in prep.replay_ids]
    partial = [i for i in result.partial_ids if i not in prep.replay_ids]  # stay pending either way
    blamed = _blame(ctx, prep, verdict, set(new_ids))
    ctx.stop_gpu()  # the version's energy: load, train and evaluate
    with ctx.phase(Phase.publish), StateLock(StatePaths(ctx.state).lock, what="publish"):
        registry.clean_stale()
        in_service = registry.current_version()
        passed = verdict.passed
        if passed and in_service != planned.parent:  # an operator promoted or rolled back while this night ran
            passed = False  # the candidate was judged against (and trained from) what is no longer served
            verdict.held_back = (f"the version in service changed during the night (v{planned.parent} -> "
                                 f"v{in_service}); promote it by hand if wanted")
            log.warning("not_promoted", reason=verdict.held_back)
        final = registry.path_of(cfg.model.name, planned.version)
        if final.exists() or final.is_symlink():
            _discard_own_unrecorded(ctx, final, planned.version)
        tmp = registry.new_tmp_dir(version_name(cfg.model.name, planned.version))
        save_version(prep.loaded, tmp)  # an adapter, or a whole model (method = "full")
        verdict.new_reference = passed and gate.better_than(
            s.metrics.get("regression_after"), s.metrics.get("regression_reference"),
            reference_is_base=prep.sets.reference is None)
        manifest = _manifest(ctx, prep, planned, result, new_ids, replayed, passed)
        manifest["size_bytes"] = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())  # retention, disk
        path = registry.publish(tmp, cfg.model.name, planned.version, manifest)
        with ledger.tx() as c:
            ledger.set_version(c, planned.version, status="promoted" if passed else "rejected", path=str(path),
                               manifest=manifest, promoted=passed)
            learning.record_loss_curve(c, ctx.run_id, result.loss_curve)
            if passed:
                ledger.mark_trained(c, new_ids, planned.version)
                ledger.mark_heldout(c, prep.heldout_ids, planned.version)
                learning.add_regression_slices(ledger, c, ledger.samples_by_id(prep.heldout_ids), night=ctx.night,
                                               version=planned.version, per_slice=cfg.eval.regression_per_slice)
                ledger.record_promotion(c, planned.version, action="night", from_version=in_service,
                                        run_id=ctx.run_id)
                if verdict.new_reference:
                    learning.set_reference(ledger, c, planned.version, run_id=ctx.run_id,
                                           detail={"regression": s.metrics.get("regression_after")})
            else:
                back = new_ids + partial + prep.heldout_ids
                if blamed is not None:  # the blamed files held; the rest of the night learns tomorrow, uncounted
                    for fid in blamed.blamed:
                        row = file_strikes.strike(ledger, c, fid, version=planned.version,
                                                  reason=f"{verdict.failed()}; harm {blamed.harm[fid]:.2f} > "
                                                         f"max(replay's {blamed.yardstick:.2f} + {isolate.MARGIN}, 0)")
                        s.isolated[row.path] = f"{row.status}: {row.reason}"
                    held = {i for f in blamed.blamed for i in file_strikes.files_of(ledger, back).get(f, [])}
                    back = [i for i in back if i not in held]
                s.returned_samples, s.set_aside_samples = learning.return_rejected(
                    ledger, c, back, version=planned.version,
                    reason=verdict.held_back or verdict.failed() or "rejected", mode=cfg.plan.rejected_samples,
                    set_aside_after=cfg.plan.set_aside_after, count=verdict.held_back is None and blamed is None)
            s.regression_samples = learning.regression_size(ledger)[0]
        reached(VERSION_RECORDED)
        if passed:
            registry.promote(path)
    s.promoted, s.adapter_path = passed, str(path)
    return Published(planned.version, path, passed)


def _blame(ctx: RunContext, prep: Prepared, verdict: GateResult, new_ids: set[int]) -> isolate.Blame | None:
    """A rejected night's files scored (jobs/night/isolate.py); None: nothing blamed, or not rejected for its
    data (held back), or configured to reject whole nights (`[plan] rejected_samples = "rejected"`)."""
    if verdict.passed or verdict.held_back or ctx.cfg.plan.rejected_samples != "pending":
        return None
    failed = [(c.name.split(".")[0], c.against) for c in verdict.checks if not c.passed and not c.skipped]
    new = [x for x in prep.train_set if x.sample_id in new_ids]
    replay = [x for x in prep.train_set if x.sample_id in prep.replay_ids]
    return isolate.on_rejection(ctx, prep.loaded, prep.sets, new, replay, failed)


def _discard_own_unrecorded(ctx: RunContext, final: Path, version: int) -> None:
    """A directory under our number before we publish. Only this run's own unrecorded rename (a kill
    between the rename and the ledger's commit: never recorded, never served) may go; anything else
    is a published version, and those are write-once for everyone."""
    row = ctx.ledger.version(version)
    ours = row is not None and row["status"] == "training" and row["run_id"] == ctx.run_id
    if not ours or final.is_symlink() or ctx.registry.current() == final.resolve() or ctx.ledger.hotswaps(version):
        raise DamagedState(f"{final} already exists and is not this run's own unfinished attempt: published "
                           "versions are write-once, refusing to replace it; `nightshift doctor` explains")
    aside = ctx.registry.new_tmp_dir(f"replaced-{final.name}")
    os.rename(final, aside / final.name)
    shutil.rmtree(aside, ignore_errors=True)
    log.info("unrecorded_attempt_replaced", path=str(final))


def _manifest(ctx: RunContext, prep: Prepared, planned: PlannedRun, result: TrainResult, new_ids: list[int],
              replayed: list[int], promoted: bool) -> dict[str, Any]:
    """What the version says of itself: lineage, data, figures, the gate's decision, the config."""
    cfg, s, ledger = ctx.cfg, ctx.summary, ctx.ledger
    samples, replay_rows = ledger.samples_by_id(new_ids), ledger.samples_by_id(replayed)
    p = planned.plan
    return {
        "version": planned.version, "name": version_name(cfg.model.name, planned.version),
        "method": (s.method or cfg.train.method).value, "kind": "adapter" if cfg.train.method.is_adapter else "model",
        "parent_version": planned.parent, "run_id": ctx.run_id, "night": ctx.night, "created_at": time.time(),
        "code_version": nightshift_version(),
        "base_model": {"path": str(ctx.model_path), "fingerprint": ctx.fingerprint},
        "energy": {**energy_fields(s.gpu, result.tokens), "gpu": s.gpu.model_dump() if s.gpu else None},
        "data": {"fingerprint": data_fingerprint([x.hash for x in samples]), "samples": len(samples),
                 "tokens": result.tokens, "heldout_samples": len(prep.heldout_ids),
                 "replay_samples": len(replay_rows), "replay_tokens": sum(x.n_tokens for x in replay_rows),
                 "replay_fingerprint": data_fingerprint([x.hash for x in replay_rows])},
        "training": {"backend": p.backend, "device": p.device, "steps": result.steps,
                     "tokens_per_second": s.tokens_per_second, "seconds": result.seconds,
                     "stopped": result.stopped, "resumed_from_step": result.resumed_from_step,
                     **result.detail.manifest_fields(), **prep.loaded.info},
        "losses": s.losses.model_dump(), "metrics": s.metrics,
        "gate": s.gate.model_dump() if s.gate else None, "promoted": promoted,
        "not_evaluated": s.not_evaluated, "regression_slices": prep.slices,
        "kl_from_service": s.kl_from_service, "isolated": s.isolated,
        "loss_curve": loss_curve_points(result.loss_curve),
        "phase_seconds": s.phase_seconds,
        "plan": {"predicted_train_seconds": p.predicted_train_seconds, "tokens_per_second": p.tokens_per_second,
                 "basis": p.basis, "train_tokens": p.train_tokens, "deferred_samples": p.deferred_samples,
                 "planned_tokens": s.planned_tokens},
        "replay_share": cfg.plan.replay_share, "cut_samples": s.cut_samples,
        "config": shareable_config(cfg),
    }


def shareable_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as the manifest keeps it (group-readable, sent to receivers): hot-swap targets
    by name and kind only, never their URLs, paths of secrets or commands."""
    conf = cfg.model_dump(mode="json")
    hs = conf.get("hotswap") or {}
    conf["hotswap"] = {**hs, "targets": [{"name": t.get("name"), "kind": t.get("kind")}
                                         for t in hs.get("targets", [])]}
    return conf


def announce_version(ctx: RunContext, version: int, path: Path) -> list[HotswapOutcome]:
    """Tell every [hotswap] target. Each outcome goes to the ledger, the log and a child event;
    a failure (or an altered adapter) never undoes the publication."""
    def on_outcome(o: HotswapOutcome) -> None:
        ctx.emit(HotswapEvent(version=version, outcome=o))
        ctx.summary.hotswap.append(o)

    with ctx.phase(Phase.hotswap):
        try:
            return announce(ctx.registry, ctx.ledger, ctx.cfg.hotswap, version, path, trigger="night",
                            run_id=ctx.run_id, on_outcome=on_outcome) or []
        except Exception as e:  # integrity, lock, newest-name file: the publication stands regardless
            ctx.summary.hotswap_error = f"{type(e).__name__}: {e}"
            log.error("hotswap.refused", version=version, error=ctx.summary.hotswap_error)
            return []


def close_run(ctx: RunContext, planned: PlannedRun, result: TrainResult, published: Published) -> None:
    """Record the measured throughput for the next plans, close the run, drop its checkpoints."""
    s = ctx.summary
    overhead = sum(s.phase_seconds.get(p.value, 0.0) for p in (Phase.load, Phase.evaluate, Phase.publish))
    tokens, seconds = result.tokens, result.seconds
    if tokens > result.warmup_tokens and seconds > result.warmup_seconds:  # the steady rate; warm-up is overhead
        tokens, seconds = tokens - result.warmup_tokens, seconds - result.warmup_seconds
        overhead += result.warmup_seconds
    if result.checkpoint_seconds < seconds:  # saves are planned per save (make_plan), not in the rate
        seconds -= result.checkpoint_seconds
    if result.ramp_seconds < seconds:  # the settling steps' excess: overhead, planned again as warm-up
        seconds -= result.ramp_seconds
        overhead += result.ramp_seconds
    ctx.measures.record_throughput(key=planned.key, run_id=ctx.run_id, origin="run", tokens=tokens,
                                 seconds=seconds, overhead_seconds=overhead,
                                 detail={"steps": result.steps, "backend": planned.plan.backend,
                                         "device": planned.plan.device,
                                         "tokens_per_step": result.detail.tokens_per_step,
                                         "gradient_checkpointing": result.detail.gradient_checkpointing,
                                         "mean_sample_tokens": mean_sample_tokens(planned.plan),
                                         "warmup_tokens": result.warmup_tokens,
                                         "warmup_seconds": round(result.warmup_seconds + result.ramp_seconds, 3),
                                         "ramp_seconds": round(result.ramp_seconds, 3),
                                         "checkpoints": result.checkpoints,
                                         "checkpoint_seconds": round(result.checkpoint_seconds, 3)})
    ctx.finish("succeeded" if published.promoted else "rejected")
    remove_checkpoints(ctx)


def mean_sample_tokens(plan: Plan) -> float | None:
    """The length the night's rate was measured at (the planner moves it along calibrate's length line)."""
    n = len(plan.train_ids) + len(plan.replay_ids)
    return round(plan.train_tokens / n, 1) if n else None


def finish_published(ctx: RunContext, row: Any) -> None:
    """The version was recorded before a crash: make `current` agree, announce it, close the run."""
    s = ctx.summary
    path, version = Path(row["path"]), int(row["version"])
    promoted = row["status"] == "promoted"
    if promoted and ctx.registry.current() != path.resolve() and not _moved_on(ctx, version):
        with StateLock(StatePaths(ctx.state).lock, what="publish"):
            ctx.registry.promote(path)
    if promoted and not ctx.ledger.hotswaps(version):
        announce_version(ctx, version, path)
    manifest = json.loads(row["manifest"] or "{}")
    s.promoted, s.adapter_path, s.steps = promoted, str(path), 0  # nothing trained by this attempt
    s.method = method_of(manifest)
    s.losses = Losses.model_validate(manifest.get("losses") or {})
    s.trained_samples = int(manifest.get("data", {}).get("samples", 0))
    s.replay_samples = int(manifest.get("data", {}).get("replay_samples", 0))
    ctx.finish("succeeded" if promoted else "rejected")
    remove_checkpoints(ctx)
    log.info("finished_already_published_version", version=version)


def _moved_on(ctx: RunContext, version: int) -> bool:
    """An operator promoted or rolled back after the night recorded its promotion (in the same
    transaction as the version): leave `current` where the operator put it."""
    history = ctx.ledger.promotions()
    return bool(history) and int(history[-1]["version"]) != version


MAX_CURVE_POINTS = 5000  # beyond, the manifest's curve averages buckets of steps (the ledger keeps every step)


def loss_curve_points(curve: list[tuple[int, float]]) -> list[dict[str, float | int]]:
    """The manifest's `loss_curve`: [{"step": int, "loss": float}], every step up to MAX_CURVE_POINTS;
    longer runs average consecutive steps (each point at the bucket's last step)."""
    k = max(1, -(-len(curve) // MAX_CURVE_POINTS))
    out: list[dict[str, float | int]] = []
    for i in range(0, len(curve), k):
        bucket = curve[i : i + k]
        out.append({"step": int(bucket[-1][0]), "loss": sum(v for _, v in bucket) / len(bucket)})
    return out


def data_fingerprint(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16]


def remove_checkpoints(ctx: RunContext) -> None:
    shutil.rmtree(ctx.checkpoints, ignore_errors=True)
