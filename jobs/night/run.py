"""One night's work, step by step: pull -> plan -> load -> train -> evaluate -> publish.

Runs in the child process (jobs/child.py); reports through `emit` (the event protocol
read by the daemon) and returns the RunSummary. Every step is idempotent against the
ledger: a rerun of the same night resumes the open run with its stored plan, from
its last checkpoint, and trains nothing twice.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from jobs import plan as budget
from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.evaluate import EvalConfig
from jobs.gpu import GpuConfig, GpuSampler, torch_device_uuid, torch_peak_memory
from jobs.hotswap import HotswapConfig
from jobs.plan import PlanConfig
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.registry import Registry, version_name
from jobs.training.loop import TrainConfig

log = structlog.get_logger("nightshift.night")
Emit = Callable[[dict[str, Any]], None]


class ModelConfig(BaseModel):
    """[model]"""

    model_config = ConfigDict(extra="forbid")
    path: Path = Field(description="local Hugging Face model directory (nothing is downloaded)")
    name: str = Field("adapter", pattern=r"^[A-Za-z0-9_.-]+$", description="adapter name: <name>-v0001")
    build: Literal["tiny-llama"] | None = Field(
        None, description="build this random-initialised model at `path` when it is missing (the demo)")


class NightConfig(BaseModel):
    """Everything the child needs: the job sections of the settings."""

    model_config = ConfigDict(extra="forbid")
    state_dir: Path
    model: ModelConfig
    sources: list[SourceConfig] = Field(default_factory=list)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    hotswap: HotswapConfig = Field(default_factory=HotswapConfig)  # no targets: nothing announced
    gpu: GpuConfig = Field(default_factory=GpuConfig)


@dataclass
class Night:
    """Mutable state of one run while it goes; becomes the RunSummary."""

    cfg: NightConfig
    ledger: Ledger
    registry: Registry
    emit: Emit
    clock: Callable[[], float]
    night: str
    deadline: float
    run_id: str = ""
    s: dict[str, Any] = field(default_factory=dict)
    gpu: GpuSampler | None = None

    def stop_gpu(self) -> None:
        """Close the GPU telemetry of the run: the summary gets power, energy and peak memory."""
        if self.gpu is not None:
            self.s["gpu"] = self.gpu.stop()
            self.gpu = None

    @contextmanager
    def phase(self, name: str):
        started = self.clock()
        self.emit({"event": "phase", "phase": name, "state": "start", "seconds": None})
        try:
            yield
        finally:
            secs = self.clock() - started
            self.ledger.record_phase(self.run_id, name, started, secs)
            self.s["phase_seconds"][name] = self.s["phase_seconds"].get(name, 0.0) + secs
            self.emit({"event": "phase", "phase": name, "state": "end", "seconds": secs})


def empty_summary(run_id: str, night: str, deadline: float, started: float, base_model: str) -> dict[str, Any]:
    return {
        "run_id": run_id, "night": night, "outcome": "failed", "version": None, "version_name": None,
        "promoted": False, "parent_version": None, "files_ingested": 0, "ingested": {}, "duplicates": 0,
        "quarantined": {}, "trained_samples": 0, "trained_tokens": 0, "replay_samples": 0,
        "deferred_samples": 0, "backlog_samples": 0, "backlog_tokens": 0, "steps": 0,
        "tokens_per_second": None, "samples_per_hour": None, "predicted_train_seconds": None,
        "actual_train_seconds": None, "phase_seconds": {},
        "losses": {"train": None, "heldout_before": None, "heldout_after": None,
                   "regression_before": None, "regression_after": None},
        "gpu": None, "started_at": started, "ended_at": None, "deadline": deadline, "error": None,
        "base_model": base_model, "adapter_path": None, "heldout_samples": 0, "plan_basis": None,
        "stopped": None, "gate": None,
    }


def ensure_model(cfg: NightConfig) -> Path:
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return path
    if cfg.model.build == "tiny-llama":
        from jobs.training.tinymodel import build_tiny_llama

        corpus = [p for src in cfg.sources for pat in ("*.jsonl", "*.json") for p in Path(src.inbox).glob(pat)]
        log.info("building_tiny_model", path=str(path), corpus_files=len(corpus))
        with StateLock(Path(cfg.state_dir) / "lock", what="build model"):
            if not (path / "config.json").exists():
                build_tiny_llama(path, corpus)
        return path
    raise FileNotFoundError(f"[model] path: {path} is not a model directory (no config.json); "
                            "nightshift loads models from local paths only")


def model_fingerprint(path: Path) -> str:
    """Cheap identity of a model dir: config + every weight file's name, size, head and tail."""
    h = hashlib.sha256()
    for p in sorted(Path(path).iterdir()):
        if p.name == "config.json":
            h.update(p.read_bytes())
        elif p.suffix in (".safetensors", ".bin"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}".encode())
            with open(p, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, st.st_size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def throughput_parts(cfg: NightConfig, fingerprint: str, backend: str, device: str) -> dict[str, Any]:
    t = cfg.train
    return {"model": fingerprint, "backend": backend, "device": device, "rank": t.lora_rank,
            "targets": t.target_modules, "batch_size": t.batch_size, "max_tokens": t.max_tokens_per_batch,
            "max_seq": t.max_seq_length, "grad_ckpt": t.gradient_checkpointing, "4bit": t.load_in_4bit,
            "batching": t.batching, "tokens_per_step": t.tokens_per_step, "max_vram_gb": cfg.gpu.max_vram_gb}


def code_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nightshift")
    except PackageNotFoundError:
        return "unknown"


def run_night(cfg: NightConfig, *, night: str, deadline: float, emit: Emit, stop: threading.Event,
              clock: Callable[[], float] = time.time, plan_only: bool = False) -> dict[str, Any]:
    from jobs.training.loop import device_name, load_tokenizer, resolve_backend

    state = Path(cfg.state_dir)
    ledger = Ledger(state / "ledger.sqlite", clock=clock)
    registry = Registry(state)
    model_path = ensure_model(cfg)
    n = Night(cfg, ledger, registry, emit, clock, night, deadline)
    open_run = None if plan_only else ledger.open_run(night)
    if open_run is not None:
        n.run_id = open_run["id"]
        attempt = ledger.resume_run(n.run_id, deadline)
        log.info("resuming_run", run_id=n.run_id, attempt=attempt)
    else:
        n.run_id = f"{'plan' if plan_only else night}-{secrets.token_hex(3)}"
        if not plan_only:
            ledger.start_run(n.run_id, night, deadline)
    structlog.contextvars.bind_contextvars(run_id=n.run_id)
    n.s = empty_summary(n.run_id, night, deadline, clock(), str(model_path))
    if cfg.gpu.enabled and not plan_only:
        n.gpu = GpuSampler(emit, hz=cfg.gpu.sample_hz, device=torch_device_uuid() or cfg.gpu.device,
                           peak_memory=torch_peak_memory)
        if not n.gpu.start():
            n.gpu = None  # no GPU here: the GPU figures stay absent
    try:
        _run(n, model_path, open_run, plan_only, stop, resolve_backend(cfg.train), device_name(),
             load_tokenizer(model_path))
    except Exception as e:
        # The run stays open: its supervisor retries (resuming from the last checkpoint) or
        # closes it as failed once the attempts or the window are used up.
        n.s["outcome"], n.s["error"] = "failed", f"{type(e).__name__}: {e}"
        log.exception("run_failed", error=n.s["error"])
        if not plan_only:
            ledger.add_event("attempt_failed", run_id=n.run_id, detail={"night": night, "error": n.s["error"]})
    finally:
        n.stop_gpu()
        n.s["ended_at"] = clock()
        n.s["backlog_samples"], n.s["backlog_tokens"] = ledger.backlog()
        if not plan_only:
            ledger.store_summary(n.run_id, n.s)
        ledger.close()
    return n.s


def _run(n: Night, model_path: Path, open_run: Any, plan_only: bool, stop: threading.Event, backend: str,
         device: str, tokenizer: Any) -> None:
    cfg, ledger, s = n.cfg, n.ledger, n.s
    state = Path(cfg.state_dir)
    with n.phase("pull"):
        res = pull(cfg.sources, ledger, tokenizer, run_id=n.run_id,
                   quarantine=Quarantine(state / "quarantine" / f"{n.run_id}.jsonl"),
                   max_seq_length=cfg.train.max_seq_length, overlong=cfg.train.overlong,
                   cache_dir=state / "cache" / "datasets")
        s.update(files_ingested=res.files, ingested=dict(res.ingested), duplicates=res.duplicates,
                 quarantined=dict(res.quarantined))
    fingerprint = model_fingerprint(model_path)
    key = budget.throughput_key(throughput_parts(cfg, fingerprint, backend, device))
    parent = n.registry.current_version()
    with n.phase("plan"):
        if open_run is not None and open_run["plan"]:
            plan_d = json.loads(open_run["plan"])
            version = int(open_run["version"])
            roles = ledger.run_samples(n.run_id)
            parent = plan_d["parent_version"]
        else:
            p = budget.make_plan(ledger.pending(order=cfg.plan.order), now=n.clock(), deadline=n.deadline,
                                 history=ledger.throughput_history(key, cfg.plan.history_runs), cfg=cfg.plan,
                                 epochs=cfg.train.epochs, key=key, replay_pool=ledger.replay_pool(), seed=n.run_id)
            version = ledger.next_version()
            plan_d = {**p.to_dict(), "version": version, "parent_version": parent, "backend": backend,
                      "device": device}
            roles = p.roles()  # new samples with replay mixed in, then held-out
            if not plan_only and p.train_ids:
                ledger.save_plan(n.run_id, plan_d, roles, version, version_name(cfg.model.name, version), parent)
        n.emit({"event": "plan", "plan": plan_d})
        log.info("plan", samples=len(plan_d["train_ids"]), tokens=plan_d["train_tokens"],
                 heldout=len(plan_d["heldout_ids"]), deferred=plan_d["deferred_samples"],
                 predicted_train_seconds=round(plan_d["predicted_train_seconds"], 1), basis=plan_d["basis"])
    s.update(predicted_train_seconds=plan_d["predicted_train_seconds"], plan_basis=plan_d["basis"],
             deferred_samples=plan_d["deferred_samples"], parent_version=parent,
             heldout_samples=len(plan_d["heldout_ids"]), plan=plan_d)
    if plan_only:
        s["outcome"] = "skipped"
        return
    if not plan_d["train_ids"]:
        s["outcome"] = "skipped"
        s["error"] = "nothing to train: no pending samples fit" if plan_d["deferred_samples"] else "no new samples"
        ledger.finish_run(n.run_id, "skipped", summary=s, error=s["error"])
        return
    from jobs.night.train_publish import train_evaluate_publish

    train_evaluate_publish(n, model_path, plan_d, roles, version, parent, backend, device, key, fingerprint,
                           stop)


def data_fingerprint(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16]


def remove_checkpoints(state: Path, run_id: str) -> None:
    shutil.rmtree(state / "checkpoints" / run_id, ignore_errors=True)
