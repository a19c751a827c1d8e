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
from jobs.locking import StateLock
from jobs.night import Night, code_version, data_fingerprint, remove_checkpoints
from jobs.registry import version_name
from jobs.render import tokenize_record
from jobs.train import latest_checkpoint, load_for_training, train

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
        loaded = load_for_training(model_path, cfg.train, adapter=resume or parent_path)
        tok = loaded.tokenizer
        train_ids = [sid for sid, role in roles if role == "train"]
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

    def losses(prefix: str) -> dict[str, float | None]:
        kw = {"pad_id": tok.pad_token_id, "device": loaded.device,
              "max_tokens_per_batch": cfg.eval.max_tokens_per_batch}
        return {f"heldout_{prefix}": evaluate.eval_loss(loaded.model, held, **kw),
                f"regression_{prefix}": evaluate.eval_loss(loaded.model, regression, **kw)}

    before_file = ckpt_root / "before.json"
    with n.phase("evaluate"):
        if before_file.exists():
            before = json.loads(before_file.read_text())
        else:
            before = losses("before")
            ckpt_root.mkdir(parents=True, exist_ok=True)
            before_file.write_text(json.dumps(before))
    s["losses"].update(before)

    def progress(p: dict[str, Any]) -> None:
        n.emit({"event": "progress", "version": version, **p})

    with n.phase("train"):
        result = train(loaded, train_set, cfg.train, ckpt_root=ckpt_root, deadline=n.deadline, stop=stop,
                       clock=n.clock, on_progress=progress, resume=resume)
    s.update(trained_samples=len(result.trained_ids), trained_tokens=result.tokens, steps=result.steps,
             actual_train_seconds=result.seconds, stopped=result.stopped)
    s["losses"]["train"] = result.mean_loss
    if result.seconds > 0:
        s["tokens_per_second"] = result.tokens / result.seconds
        s["samples_per_hour"] = len(result.trained_ids) * 3600 / result.seconds
    if result.stopped == "signal":
        s["outcome"] = "interrupted"  # the run stays open: the next start resumes from the checkpoint
        log.info("run_interrupted", next_batch=result.detail["batches_done"], of=result.detail["batches"])
        return
    if not result.trained_ids:
        s["outcome"], s["error"] = "skipped", "the deadline left no time for a single step"
        ledger.finish_run(n.run_id, "skipped", summary=s, error=s["error"])
        return

    with n.phase("evaluate"):
        s["losses"].update(losses("after"))
    passed, checks = evaluate.gate(s["losses"], cfg.eval)
    s["gate"] = {"passed": passed, "checks": [c.__dict__ for c in checks]}
    log.info("gate", passed=passed, checks=s["gate"]["checks"])

    with n.phase("publish"), StateLock(state / "lock", what="publish"):
        registry.clean_stale()
        final = registry.path_of(cfg.model.name, version)
        if final.exists():  # renamed by a run killed before the ledger recorded it: never served
            shutil.rmtree(final)
        tmp = registry.new_tmp_dir(name)
        loaded.model.save_pretrained(str(tmp))
        samples = ledger.samples_by_id(result.trained_ids)
        manifest = {
            "version": version, "name": name, "parent_version": parent, "run_id": n.run_id, "night": n.night,
            "created_at": time.time(), "code_version": code_version(),
            "base_model": {"path": str(model_path), "fingerprint": fingerprint},
            "data": {"fingerprint": data_fingerprint([x.hash for x in samples]), "samples": len(samples),
                     "tokens": result.tokens, "heldout_samples": len(heldout_ids)},
            "training": {"backend": backend, "device": device, "steps": result.steps,
                         "tokens_per_second": s["tokens_per_second"], "seconds": result.seconds,
                         "stopped": result.stopped, "resumed_from_step": result.resumed_from_step,
                         **loaded.info},
            "losses": s["losses"], "gate": s["gate"], "promoted": passed,
            "phase_seconds": s["phase_seconds"], "plan": {k: plan[k] for k in (
                "predicted_train_seconds", "tokens_per_second", "basis", "train_tokens", "deferred_samples")},
            "config": json.loads(cfg.model_dump_json()),
        }
        path = registry.publish(tmp, cfg.model.name, version, manifest)
        with ledger.tx() as c:
            ledger.set_version(c, version, status="promoted" if passed else "rejected", path=str(path),
                               manifest=manifest, promoted=passed)
            ledger.mark_trained(c, result.trained_ids, version)
            ledger.mark_heldout(c, heldout_ids, version)
        if passed:
            registry.promote(path)
    s.update(promoted=passed, adapter_path=str(path))
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
    if promoted and n.registry.current() != path.resolve():
        with StateLock(Path(n.cfg.state_dir) / "lock", what="publish"):
            n.registry.promote(path)
    manifest = json.loads(row["manifest"] or "{}")
    s.update(promoted=promoted, adapter_path=str(path), losses=manifest.get("losses", s["losses"]),
             trained_samples=manifest.get("data", {}).get("samples", 0))
    s["outcome"] = "succeeded" if promoted else "rejected"
    n.ledger.finish_run(n.run_id, s["outcome"], summary=_jsonable(s))
    remove_checkpoints(Path(n.cfg.state_dir), n.run_id)
    log.info("finished_already_published_version", version=row["version"])


def _jsonable(s: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(s, default=str))
