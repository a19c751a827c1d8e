"""The night on several ranks: what rank 0 hands the others, and the night as the others see it.

Rank 0 owns the night's state: the ledger, the plan, the registry, publication, hot-swap and the
events to the daemon. The other ranks touch none of it: once rank 0 has pulled, planned and loaded,
it broadcasts a TrainJob (the tokenised training set in plan order, the step shape, the deadline
and the adapter to start from); each rank loads the same base model from its own `[model] path`,
trains its share of every step with rank 0 (jobs/training/loop.py, jobs/training/ranks/collectives.py)
and exits. Rank 0 then evaluates, publishes and announces alone.

Ranks on rank 0's host read the start adapter (a checkpoint or the adapter in service) from its path;
ranks on other hosts get its files in the job and write them to their own state directory.
"""

from __future__ import annotations

import io
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import StepShape
from jobs.data.batching import TokenizedSample
from jobs.night.candidate import Prepared
from jobs.night.config import NightConfig
from jobs.night.context import RunContext
from jobs.night.intake import PlannedRun
from jobs.night.model import ensure_model, model_fingerprint
from jobs.store.paths import StatePaths
from jobs.training.config import TrainConfig
from jobs.training.ranks.collectives import Solo

log = structlog.get_logger("nightshift.night")


@dataclass
class TrainJob:
    """Everything a rank other than 0 needs to train its share of the night."""

    run_id: str
    night: str
    deadline: float  # rank 0's: the ranks still agree on every stop together
    train: dict[str, Any]  # rank 0's [train] (model_dump)
    shape: StepShape
    fingerprint: str  # of rank 0's base model: every rank must train the same one
    samples: bytes  # the training set in plan order (encode_samples)
    start: str | None  # the adapter to continue, on rank 0's host: a checkpoint or the adapter in service
    resume: bool  # `start` is a checkpoint (optimizer state and position too)
    probe_first: bool = False  # rank 0 opens with probe steps (nothing measured yet): the same batch sequence
    files: dict[str, bytes] = field(default_factory=dict)  # start's files, for ranks on other hosts


def encode_samples(samples: list[TokenizedSample]) -> bytes:
    """Compact: token ids (int32), a trained-on mask, lengths and ids; about 5 bytes a token."""
    import numpy as np

    ids = np.fromiter((t for s in samples for t in s.input_ids), dtype=np.int32)
    trained = np.fromiter((x != -100 for s in samples for x in s.labels), dtype=np.bool_)
    buf = io.BytesIO()
    np.savez(buf, ids=ids, trained=trained, lengths=np.array([s.n_tokens for s in samples], dtype=np.int64),
             sample_ids=np.array([s.sample_id for s in samples], dtype=np.int64))
    return buf.getvalue()


def decode_samples(blob: bytes) -> list[TokenizedSample]:
    import numpy as np

    z = np.load(io.BytesIO(blob))
    ids, trained = z["ids"].tolist(), z["trained"].tolist()
    out, start = [], 0
    for sid, n in zip(z["sample_ids"].tolist(), z["lengths"].tolist(), strict=True):
        chunk = ids[start: start + n]
        out.append(TokenizedSample(sid, chunk, [t if m else -100 for t, m in zip(chunk, trained[start: start + n],
                                                                                  strict=True)]))
        start += n
    return out


def share_job(group: Solo, *, run_id: str, night: str, deadline: float, cfg: NightConfig, shape: StepShape,
              fingerprint: str, samples: list[TokenizedSample], start: Path | None, resume: bool,
              probe_first: bool = False) -> None:
    """Rank 0: hand the other ranks their night (nothing for a single process)."""
    if group.world == 1:
        return
    files = ({p.name: p.read_bytes() for p in start.iterdir() if p.is_file()}
             if start is not None and group.nnodes > 1 else {})
    group.broadcast(TrainJob(run_id=run_id, night=night, deadline=deadline, train=cfg.train.model_dump(mode="json"),
                             shape=shape, fingerprint=fingerprint, samples=encode_samples(samples),
                             start=str(start) if start else None, resume=resume, files=files,
                             probe_first=probe_first))


def share_prepared(ctx: RunContext, prep: Prepared, planned: PlannedRun) -> None:
    """Rank 0, once the model and the data are loaded: the other ranks' job, from the run's context."""
    if ctx.group.world == 1:
        return
    parent = ctx.registry.path_of(ctx.cfg.model.name, planned.parent) if planned.parent else None
    share_job(ctx.group, run_id=ctx.run_id, night=ctx.night, deadline=ctx.deadline, cfg=ctx.cfg, shape=prep.shape,
              fingerprint=ctx.fingerprint, samples=prep.train_set, start=prep.resume or parent,
              resume=prep.resume is not None, probe_first=not planned.plan.measured)


def follow_night(cfg: NightConfig, group: Solo, stop: threading.Event) -> None:
    """A rank other than 0: wait for rank 0's job, train its share of every step, leave."""
    from jobs.training.load import load_for_training
    from jobs.training.loop import train

    _import_training_stack()  # while rank 0 pulls and plans: the job's wait is spent, not added
    job: TrainJob | None = group.broadcast(None)
    if job is None:
        log.info("rank_released", rank=group.rank, reason="rank 0 has nothing to train (or failed first)")
        return
    structlog.contextvars.bind_contextvars(run_id=job.run_id, rank=group.rank)
    model_path = ensure_model(cfg)
    if (fp := model_fingerprint(model_path)) != job.fingerprint:
        raise ValueError(f"[model] path: {model_path} on this host is not rank 0's base model (fingerprint {fp}, "
                         f"rank 0 has {job.fingerprint}): every host needs the same model directory")
    scratch = StatePaths(cfg.state_dir).rank_scratch(job.run_id, group.rank)
    start = _start_here(job, scratch)
    train_cfg = TrainConfig.model_validate(job.train)
    try:
        loaded = load_for_training(model_path, train_cfg, adapter=start, shape=job.shape,
                                   cache_dir=StatePaths(cfg.state_dir).models, max_vram_gb=cfg.gpu.max_vram_gb)
        result = train(loaded, decode_samples(job.samples), train_cfg, ckpt_root=scratch / "checkpoints",
                       deadline=job.deadline, stop=stop, shape=job.shape, resume=start if job.resume else None,
                       probe_first=job.probe_first, group=group)
        log.info("rank_done", steps=result.steps, stopped=result.stopped, next_batch=result.detail.batches_done)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _import_training_stack() -> None:
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def _start_here(job: TrainJob, scratch: Path) -> Path | None:
    """The start adapter on this host: rank 0's path, or its files written here (another host)."""
    if job.start is None:
        return None
    if not job.files:
        return Path(job.start)
    here = scratch / "start"
    here.mkdir(parents=True, exist_ok=True)
    for name, data in job.files.items():
        (here / name).write_bytes(data)
    return here
