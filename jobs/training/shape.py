"""The step shape of a run: tokens per step and gradient checkpointing, chosen once.

Config values win; "auto" takes what `nightshift calibrate` measured for this exact model,
device and config (a typed CalibrationRecord from the ledger), else safe defaults.
"""

from __future__ import annotations

from jobs.contract import CalibrationRecord, StepShape
from jobs.training.config import TrainConfig


def resolve_step(cfg: TrainConfig, calibrated: CalibrationRecord | None) -> StepShape:
    basis = []
    tokens = cfg.tokens_per_step
    if tokens == "auto":
        if calibrated is not None:
            tokens = calibrated.tokens_per_step
            basis.append(f"tokens per step calibrated under max_vram_gb={calibrated.max_vram_gb:g}")
        else:
            tokens = cfg.max_tokens_per_batch
            basis.append("tokens per step = max_tokens_per_batch (not calibrated)")
    else:
        basis.append("tokens per step from config")
    gc = cfg.gradient_checkpointing
    if gc == "auto":
        gc = calibrated.gradient_checkpointing if calibrated is not None else True
        basis.append("checkpointing " + ("calibrated" if calibrated is not None else "on (not calibrated)"))
    else:
        basis.append("checkpointing from config")
    return StepShape(tokens_per_step=max(int(tokens), cfg.max_seq_length), gradient_checkpointing=bool(gc),
                     basis="; ".join(basis))
