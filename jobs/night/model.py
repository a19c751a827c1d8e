"""The base model of the night: found (or built, for the demo) at its local path, and identified.

The identity (a fingerprint of config and weights) goes into every manifest and into the
throughput key, so measurements of one model never plan another's night.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

from jobs.contract import Method
from jobs.learning import plan as budget
from jobs.night.config import NightConfig
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths

log = structlog.get_logger("nightshift.night")


def demo_corpus(cfg: NightConfig) -> list[Path]:
    """The files the demo tokenizer learns from: the JSON(L) files in the inboxes (bad ones skipped)."""
    return sorted(p for src in cfg.sources for pat in ("*.jsonl", "*.json") for p in Path(src.inbox).glob(pat)
                  if p.is_file() and not p.name.startswith("."))


@contextmanager
def model_to_read(cfg: NightConfig) -> Iterator[Path]:
    """The model for commands that change nothing (plan, validate): the demo model, when it is not
    built yet, is built as the first night would build it, in a temporary directory removed after."""
    path = Path(cfg.model.path)
    if (path / "config.json").exists() or cfg.model.build != "tiny-llama":
        yield ensure_model(cfg)
        return
    from jobs.training.models.tiny import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="nightshift-model-") as tmp:
        yield build_tiny_llama(Path(tmp) / path.name, demo_corpus(cfg))


@contextmanager
def night_model(cfg: NightConfig, *, plan_only: bool) -> Iterator[Path]:
    """The model a night (of one adapter or several) runs on: a plan reads it without building anything in the
    state directory (`model_to_read`); a night builds it where it is missing (`ensure_model`)."""
    if plan_only:
        with model_to_read(cfg) as path:
            yield path
    else:
        yield ensure_model(cfg)


def ensure_model(cfg: NightConfig) -> Path:
    path = Path(cfg.model.path)
    if (path / "config.json").exists():
        return path
    if cfg.model.build == "tiny-llama":
        from jobs.training.models.tiny import build_tiny_llama

        corpus = demo_corpus(cfg)
        log.info("building_tiny_model", path=str(path), corpus_files=len(corpus))
        with StateLock(StatePaths(cfg.state_dir).lock, what="build model"):
            if not (path / "config.json").exists():
                build_tiny_llama(path, corpus)
        return path
    if cfg.model.build and cfg.model.build.startswith("in-memory:"):  # issue 15: no weights on disk
        from jobs.training.moe.load import write_in_memory_stub

        with StateLock(StatePaths(cfg.state_dir).lock, what="build model"):
            if not (path / "config.json").exists():
                write_in_memory_stub(cfg.model.build.removeprefix("in-memory:"), path)
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


def throughput_key(cfg: NightConfig, fingerprint: str, backend: str, device: str, gpus: int = 1) -> str:
    """'The same work on the same machine': calibrate and every night of this config share it. `gpus`: the
    night's processes (one per card): measured per count; one keeps the keys recorded before it existed."""
    t = cfg.train
    parts: dict[str, object] = {
        "model": fingerprint, "backend": backend, "device": device, "rank": t.lora_rank,
        "targets": t.target_modules, "batch_size": t.batch_size, "max_tokens": t.max_tokens_per_batch,
        "max_seq": t.max_seq_length, "grad_ckpt": t.gradient_checkpointing, "4bit": t.quantized_base,
        "batching": t.batching, "tokens_per_step": t.tokens_per_step, "max_vram_gb": cfg.gpu.max_vram_gb}
    if t.compute != "auto" or t.fp8_keep_transposed:  # issue 16; the default keeps the keys measured before it
        parts.update(compute=t.compute, fp8_keep_transposed=t.fp8_keep_transposed)
    if t.fp8_storage != "auto":  # the default keeps the keys measured before it (when the copy was the default)
        parts.update(fp8_storage=t.fp8_storage)
    if t.method is not Method.qlora:  # qlora's keys stay what they were: its measured history still counts
        parts.update(method=t.method.value, optimizer=t.optimizer, in_backward=t.optimizer_in_backward)
    if t.objective != "sft":  # a preference step's rate is its own (two sequences, a reference pass)
        parts["objective"] = t.objective
    if gpus > 1:  # [distributed] measured per count of cards
        parts["gpus"] = gpus
    return budget.throughput_key(parts)
