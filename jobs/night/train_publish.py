"""The torch half of a night: load, evaluate before, train, evaluate after, gate, publish.

Kept apart from jobs/night.py so that pull and plan never import torch. Crash safety:
- killed while training: the next start resumes from the last checkpoint;
- killed after the version directory was renamed but before the ledger recorded it:
  that directory was never recorded nor served, so it is replaced on the rerun;
- killed after the ledger recorded the version: the rerun only finishes the job
  (moves `current` if promoted) and trains nothing.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from jobs import evaluate
from jobs.data.render import tokenize_record
from jobs.gpu import energy_fields
from jobs.night.run import Night, code_version, data_fingerprint, remove_checkpoints
from jobs.store.adapters import announce
from jobs.store.locking import StateLock
from jobs.store.registry import version_name
from jobs.training.loop import latest_checkpoint, load_for_training, resolve_step, train

log = structlog.get_logger("nightshift.night")


def train_evaluate_publish(n: Night, model_path: Path, plan: dict[str, Any], roles: list[tuple[int, str]],
                           version: int, parent: int | None, backend: str, device: str, key: str,
                           fingerprint: str, stop: threading.Event) -> None:
    cfg, ledger, s, registry = n.cfg, n.ledger, n.s, n.registry
    state = Path(cfg.state_dir)
    name = version_name(cfg.model.name, version)
    s.update(version=version, version_name=name)
    row = ledger.version(version)
    if row is not None and row["status"] in ("promoted", "rejected"):
        _finish_published(n, row)
        return
    ckpt_root = state / "checkpoints" / n.run_id
    resume = latest_checkpoint(ckpt_root)
    parent_path = registry.path_of(cfg.model.name, parent) if parent else None
    with n.phase("load"):
        shape = resolve_step(cfg.train, ledger.calibration(key))
        loaded = load_for_training(model_path, cfg.train, adapter=resume or parent_path, shape=shape,
                                   cache_dir=state / "models")
        tok = loaded.tokenizer
        train_ids = [sid for sid, role in roles if role in ("train", "replay")]  # plan order: replay mixed in
        replay_ids = {sid for sid, role in roles if role == "replay"}  # trained again, never re-marked
        heldout_ids = [sid for sid, role in roles if role == "heldout"]
        tk = {"max_seq_length": cfg.train.max_seq_length, "overlong": cfg.train.overlong}
        train_set = [tokenize_record(tok, r.id, r.record, **tk) for r in ledger.samples_by_id(train_ids)]
        held = [tokenize_record(tok, r.id, r.record, **tk)
                for r in ledger.samples_by_id(heldout_ids[: cfg.eval.max_eval_samples])]
        regression = (evaluate.load_regression_set(cfg.eval.regression_set, tok, limit=cfg.eval.max_eval_samples,
                                                   max_seq_length=cfg.train.max_seq_length,
                                                   cache_dir=state / "cache" / "datasets")
                      if cfg.eval.regression_set else [])
    s["gpu_info"] = loaded.info

    def measure(when: str) -> dict[str, dict[str, float] | None]:
        kw = {"pad_id": tok.pad_token_id, "device": loaded.device,
              "max_tokens_per_batch": cfg.eval.max_tokens_per_batch}
        return {f"heldout_{when}": evaluate.eval_metrics(loaded.model, held, **kw),
                f"regression_{when}": evaluate.eval_metrics(loaded.model, regression, **kw)}

    def record(measured: dict[str, dict[str, float] | None]) -> None:
        s.setdefault("metrics", {}).update(measured)
        s["losses"].update({k: (m or {}).get("loss") for k, m in measured.items()})

    before_file = ckpt_root / "before.json"
    with n.phase("evaluate"):
        if before_file.exists():  # measured by an attempt that was interrupted: the adapter then
            before = json.loads(before_file.read_text())  # in service is the one to compare with
        else:
            before = measure("before")
            ckpt_root.mkdir(parents=True, exist_ok=True)
            before_file.write_text(json.dumps(before))
    record({k: v if isinstance(v, dict) or v is None else {"loss": v} for k, v in before.items()})

    def progress(p: dict[str, Any]) -> None:
        n.emit({"event": "progress", "version": version, **p})

    with n.phase("train"):
        result = train(loaded, train_set, cfg.train, ckpt_root=ckpt_root, deadline=n.deadline, stop=stop,
                       clock=n.clock, on_progress=progress, resume=resume, shape=shape, on_event=n.emit)
    new_ids = [i for i in result.trained_ids if i not in replay_ids]
    replayed = [i for i in result.trained_ids if i in replay_ids]
    s.update(trained_samples=len(new_ids), replay_samples=len(replayed), trained_tokens=result.tokens,
             steps=result.steps, actual_train_seconds=result.seconds, stopped=result.stopped)
    s["losses"]["train"] = result.mean_loss
    if result.seconds > 0:
        s["tokens_per_second"] = result.tokens / result.seconds
        s["samples_per_hour"] = len(result.trained_ids) * 3600 / result.seconds
    if result.stopped == "signal":
        s["outcome"] = "interrupted"  # the run stays open: the next start resumes from the checkpoint
        log.info("run_interrupted", next_batch=result.detail["batches_done"], of=result.detail["batches"])
        return
    if not new_ids:
        s["outcome"], s["error"] = "skipped", "the deadline left no time for a single step"
        ledger.finish_run(n.run_id, "skipped", summary=s, error=s["error"])
        return

    with n.phase("evaluate"):
        record(measure("after"))
    passed, checks = evaluate.gate(s["losses"], cfg.eval, s["metrics"])
    s["gate"] = {"passed": passed, "checks": [c.as_dict() for c in checks]}
    log.info("gate", passed=passed, checks=s["gate"]["checks"])

    n.stop_gpu()  # the version's energy: load, train and evaluate
    with n.phase("publish"), StateLock(state / "lock", what="publish"):
        registry.clean_stale()
        in_service = registry.current_version()
        if passed and in_service != parent:  # an operator promoted or rolled back while this night ran
            passed = False  # the candidate was judged against (and trained from) what is no longer served
            s["gate"]["held_back"] = (f"the version in service changed during the night (v{parent} -> "
                                      f"v{in_service}); promote it by hand if wanted")
            log.warning("not_promoted", reason=s["gate"]["held_back"])
        final = registry.path_of(cfg.model.name, version)
        if final.exists():  # renamed by a run killed before the ledger recorded it: never served
            shutil.rmtree(final)
        tmp = registry.new_tmp_dir(name)
        loaded.model.save_pretrained(str(tmp))
        samples = ledger.samples_by_id(new_ids)
        replay_rows = ledger.samples_by_id(replayed)
        manifest = {
            "version": version, "name": name, "parent_version": parent, "run_id": n.run_id, "night": n.night,
            "created_at": time.time(), "code_version": code_version(),
            "base_model": {"path": str(model_path), "fingerprint": fingerprint},
            "energy": {**energy_fields(s["gpu"], result.tokens), "gpu": s["gpu"]},
            "data": {"fingerprint": data_fingerprint([x.hash for x in samples]), "samples": len(samples),
                     "tokens": result.tokens, "heldout_samples": len(heldout_ids),
                     "replay_samples": len(replay_rows), "replay_tokens": sum(x.n_tokens for x in replay_rows),
                     "replay_fingerprint": data_fingerprint([x.hash for x in replay_rows])},
            "training": {"backend": backend, "device": device, "steps": result.steps,
                         "tokens_per_second": s["tokens_per_second"], "seconds": result.seconds,
                         "stopped": result.stopped, "resumed_from_step": result.resumed_from_step,
                         **result.detail, **loaded.info},
            "losses": s["losses"], "metrics": s["metrics"], "gate": s["gate"], "promoted": passed,
            "phase_seconds": s["phase_seconds"], "plan": {k: plan[k] for k in (
                "predicted_train_seconds", "tokens_per_second", "basis", "train_tokens", "deferred_samples")},
            "replay_share": cfg.plan.replay_share,
            "config": json.loads(cfg.model_dump_json()),
        }
        path = registry.publish(tmp, cfg.model.name, version, manifest)
        with ledger.tx() as c:
            ledger.set_version(c, version, status="promoted" if passed else "rejected", path=str(path),
                               manifest=manifest, promoted=passed)
            ledger.mark_trained(c, new_ids, version)
            ledger.mark_heldout(c, heldout_ids, version)
            if passed:
                ledger.record_promotion(c, version, action="night", from_version=in_service, run_id=n.run_id)
        if passed:
            registry.promote(path)
    s.update(promoted=passed, adapter_path=str(path))
    if passed:
        hotswap(n, version, path)
    overhead = sum(s["phase_seconds"].get(p, 0.0) for p in ("load", "evaluate", "publish"))
    ledger.record_throughput(key=key, run_id=n.run_id, origin="run", tokens=result.tokens,
                             seconds=result.seconds, overhead_seconds=overhead,
                             detail={"steps": result.steps, "backend": backend, "device": device})
    s["outcome"] = "succeeded" if passed else "rejected"
    ledger.finish_run(n.run_id, s["outcome"], summary=_jsonable(s))
    remove_checkpoints(state, n.run_id)


def _finish_published(n: Night, row: Any) -> None:
    """The version was recorded before a crash: make `current` agree and close the run."""
    s = n.s
    path = Path(row["path"])
    promoted = row["status"] == "promoted"
    if promoted and n.registry.current() != path.resolve() and not _moved_on(n, int(row["version"])):
        with StateLock(Path(n.cfg.state_dir) / "lock", what="publish"):
            n.registry.promote(path)
    if promoted and not n.ledger.hotswaps(int(row["version"])):
        hotswap(n, int(row["version"]), path)
    manifest = json.loads(row["manifest"] or "{}")
    s.update(promoted=promoted, adapter_path=str(path), losses=manifest.get("losses", s["losses"]),
             trained_samples=manifest.get("data", {}).get("samples", 0),
             replay_samples=manifest.get("data", {}).get("replay_samples", 0))
    s["outcome"] = "succeeded" if promoted else "rejected"
    n.ledger.finish_run(n.run_id, s["outcome"], summary=_jsonable(s))
    remove_checkpoints(Path(n.cfg.state_dir), n.run_id)
    log.info("finished_already_published_version", version=row["version"])


def hotswap(n: Night, version: int, path: Path) -> None:
    """Announce the promoted version to every [hotswap] target. Each outcome goes to the ledger, the
    log and a child event; a failure (or an altered adapter) never undoes the publication."""
    def on_outcome(d: dict[str, Any]) -> None:
        n.emit({"event": "hotswap", "version": version, **d})
        n.s.setdefault("hotswap", []).append(d)

    with n.phase("hotswap"):
        try:
            announce(n.registry, n.ledger, n.cfg.hotswap, version, path, trigger="night", run_id=n.run_id,
                     on_outcome=on_outcome)
        except Exception as e:  # integrity, lock, newest-name file: the publication stands regardless
            log.error("hotswap.refused", version=version, error=f"{type(e).__name__}: {e}")
            n.s["hotswap_error"] = f"{type(e).__name__}: {e}"


def _moved_on(n: Night, version: int) -> bool:
    """An operator promoted or rolled back after the night recorded its promotion (in the same
    transaction as the version): leave `current` where the operator put it."""
    history = n.ledger.promotions()
    return bool(history) and int(history[-1]["version"]) != version


def _jsonable(s: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(s, default=str))
