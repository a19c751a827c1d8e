"""Disk a night needs in the state directory beyond `[daemon] min_free_disk_gb`, by method.

A LoRA adapter is megabytes. Full fine-tuning writes whole models: a checkpoint (the weights and
the optimizer's moments) is written next to the previous one before that is removed, and the
version is published while the last checkpoint still exists. So the peak is two checkpoints:
2 x weights x (1 + moments), moments = 2 x the weights for AdamW (kept in the weights' dtype),
about 1 x for 8-bit AdamW. The weights' size is the base model's files (no torch: the daemon asks).
"""

from __future__ import annotations

from pathlib import Path

from jobs.night.config import NightConfig


def weights_bytes(model_path: Path) -> int:
    files = list(Path(model_path).glob("*.safetensors")) or list(Path(model_path).glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def night_disk_need_gb(cfg: NightConfig) -> float:
    """0 for LoRA methods; two full checkpoints for full fine-tuning (0 while the base is not there yet)."""
    if cfg.train.method.is_adapter:
        return 0.0
    moments = 1.0 if cfg.train.optimizer == "adamw_8bit" else 2.0
    return 2 * weights_bytes(Path(cfg.model.path)) * (1 + moments) / 1e9
