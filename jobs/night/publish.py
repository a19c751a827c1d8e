"""The night's last steps: judge the candidate, publish it as an immutable version, announce it.

Crash safety:
- killed after the version directory was renamed but before the ledger recorded it: that
  directory was never recorded nor served, so it is replaced on the rerun;
- killed after the ledger recorded the version: the rerun only finishes the job (moves
  `current` if promoted, announces it if no target heard of it) and trains nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jobs import evaluate
from jobs.contract import (
    GateResult,
    HotswapEvent,
    HotswapOutcome,
    Losses,
    Phase,
    nightshift_version,
    version_name,
)
from jobs.gpu import energy_fields
from jobs.night.candidate import Prepared
from jobs.night.context import RunContext
from jobs.night.intake import PlannedRun
from jobs.night.lineage import method_of
from jobs.store.adapters import announce
from jobs.store.locking import StateLock
from jobs.training.loop import TrainResult
from jobs.training.save import save_version

log = structlog.get_logger("nightshift.night")


def judge(ctx: RunContext) -> GateResult:
    verdict = evaluate.gate(ctx.summary.losses, ctx.cfg.eval, ctx.summary.metrics)
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
    ctx.stop_gpu()  # the version's energy: load, train and evaluate
    with ctx.phase(Phase.publish), StateLock(ctx.state / "lock", what="publish"):
        registry.clean_stale()
        in_service = registry.current_version()
        passed = verdict.passed
        if passed and in_service != planned.parent:  # an operator promoted or rolled back while this night ran
            passed = False  # the candidate was judged against (and trained from) what is no longer served
            verdict.held_back = (f"the version in service changed during the night (v{planned.parent} -> "
                                 f"v{in_service}); promote it by hand if wanted")
            log.warning("not_promoted", reason=verdict.held_back)
        final = registry.path_of(cfg.model.name, planned.version)
        if final.exists():  # renamed by a run killed before the ledger recorded it: never served
            shutil.rmtree(final)
        tmp = registry.new_tmp_dir(version_name(cfg.model.name, planned.version))
        save_version(prep.loaded, tmp)  # an adapter, or a whole model (method = "full")
        manifest = _manifest(ctx, prep, planned, result, new_ids, replayed, passed)
        manifest["size_bytes"] = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())  # retention, disk
        path = registry.publish(tmp, cfg.model.name, planned.version, manifest)
        with ledger.tx() as c:
            ledger.set_version(c, planned.version, status="promoted" if passed else "rejected", path=str(path),
                               manifest=manifest, promoted=passed)
            ledger.mark_trained(c, new_ids, planned.version)
            ledger.mark_heldout(c, prep.heldout_ids, planned.version)
            if passed:
                ledger.record_promotion(c, planned.version, action="night", from_version=in_service,
                                        run_id=ctx.run_id)
        if passed:
            registry.promote(path)
    s.promoted, s.adapter_path = passed, str(path)
    return Published(planned.version, path, passed)


def _manifest(ctx: RunContext, prep: Prepared, planned: PlannedRun, result: TrainResult, new_ids: list[int],
              replayed: list[int], promoted: bool) -> dict[str, Any]:
    """What the version says of itself: lineage, data, figures, the gate's decision, the config."""
    cfg, s, ledger = ctx.cfg, ctx.summary, ctx.ledger
    samples, replay_rows = ledger.samples_by_id(new_ids), ledger.samples_by_id(replayed)
    p = planned.plan
    return {
        "version": planned.version, "name": version_name(cfg.model.name, planned.version),
        "method": cfg.train.method.value, "kind": "adapter" if cfg.train.method.is_adapter else "model",
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
                     **result.detail, **prep.loaded.info},
        "losses": s.losses.model_dump(), "metrics": s.metrics,
        "gate": s.gate.model_dump() if s.gate else None, "promoted": promoted,
        "phase_seconds": s.phase_seconds,
        "plan": {"predicted_train_seconds": p.predicted_train_seconds, "tokens_per_second": p.tokens_per_second,
                 "basis": p.basis, "train_tokens": p.train_tokens, "deferred_samples": p.deferred_samples},
        "replay_share": cfg.plan.replay_share,
        "config": cfg.model_dump(mode="json"),
    }


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
    ctx.ledger.record_throughput(key=planned.key, run_id=ctx.run_id, origin="run", tokens=result.tokens,
                                 seconds=result.seconds, overhead_seconds=overhead,
                                 detail={"steps": result.steps, "backend": planned.plan.backend,
                                         "device": planned.plan.device})
    ctx.finish("succeeded" if published.promoted else "rejected")
    remove_checkpoints(ctx)


def finish_published(ctx: RunContext, row: Any) -> None:
    """The version was recorded before a crash: make `current` agree, announce it, close the run."""
    s = ctx.summary
    path, version = Path(row["path"]), int(row["version"])
    promoted = row["status"] == "promoted"
    if promoted and ctx.registry.current() != path.resolve() and not _moved_on(ctx, version):
        with StateLock(ctx.state / "lock", what="publish"):
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


def data_fingerprint(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16]


def remove_checkpoints(ctx: RunContext) -> None:
    shutil.rmtree(ctx.checkpoints, ignore_errors=True)
