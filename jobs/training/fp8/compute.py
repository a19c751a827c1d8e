"""`[train] compute`: in which number format the frozen base projections multiply (issue 16).

- "bf16": as before (the base is NF4 or bf16 in memory, dequantised per use, bf16 tensor cores).
- "fp8": the frozen projections run their forward and input-gradient matmuls on FP8 (e4m3) tensor
  cores with per-output-channel weight scales and per-token activation scales (jobs/training/fp8/matmul.py);
  the LoRA path and everything else stay bf16. Needs a CUDA card with FP8 tensor cores (compute
  capability >= 8.9: Ada, Hopper, Blackwell) where torch's row-wise `_scaled_mm` runs.
- "auto": fp8 where the card can AND `nightshift calibrate` measured the numerics check passing for
  this model and config (CalibrationRecord.compute == "fp8"); else bf16, with the reason.

Torch-free at import: the daemon validates configs through here. What needs torch is imported inside
the one function that asks the card.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from jobs.contract import CalibrationRecord, StepShape
    from jobs.training.config import TrainConfig

Compute = Literal["bf16", "fp8"]
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)

# The numerics gate (jobs/training/fp8/numerics.py), stated once:
# - e4m3 with per-row scales on both operands gives ~3.75 % relative output error on Gaussian data
#   (2.65 % per operand, sqrt(2) of it for two; 3.75 % measured on the H100 and the H200: the benchmark's
#   FP8 error median, RESULTS.md: 2026-11-25, 8B FP8 calibrate), NF4 weights alone 9-10 %.
#   A projection above MAX_LAYER_ERROR (twice the expected figure) is broken or badly scaled: it is
#   kept in bf16 (per-layer fallback) and the check fails if any layer had to.
MAX_LAYER_ERROR = 0.08
# - the loss of a learnable task, FP8 against bf16 from the same LoRA initialisation and batches:
#   every 5-step window's mean loss within LOSS_TOLERANCE of bf16's, as a share of bf16's starting loss.
LOSS_TOLERANCE = 0.03
LOSS_WINDOW = 5


@dataclass(frozen=True)
class CardInfo:
    """What decides whether FP8 can run here (gathered by `card_info`, judged by `assess_card`)."""

    name: str  # "cpu" without CUDA
    capability: tuple[int, int] | None  # None: no CUDA device
    has_scaled_mm: bool = False
    probe_error: str | None = None  # a tiny row-wise _scaled_mm on this card failed (or gave wrong numbers)


@dataclass(frozen=True)
class ComputeChoice:
    compute: Compute
    reason: str


def assess_card(card: CardInfo) -> tuple[bool, str]:
    """(FP8 possible here, why or why not) — pure, so the rule is tested without a GPU."""
    if card.capability is None:
        return False, f"no CUDA device ({card.name}): FP8 needs a GPU with FP8 tensor cores (compute capability >= 8.9)"
    cc = f"{card.capability[0]}.{card.capability[1]}"
    if card.capability < MIN_CAPABILITY:
        return False, f"{card.name} (compute capability {cc}) has no FP8 tensor cores (needs >= 8.9)"
    if not card.has_scaled_mm:
        return False, "this torch has no torch._scaled_mm / float8_e4m3fn"
    if card.probe_error:
        return False, f"row-wise FP8 matmul failed on {card.name} (compute capability {cc}): {card.probe_error}"
    return True, f"{card.name} (compute capability {cc}) runs row-wise FP8 matmuls"


def card_info() -> CardInfo:
    """This machine's card, with a 32x32 row-wise `_scaled_mm` actually run and checked."""
    import torch

    if not torch.cuda.is_available():
        return CardInfo("cpu", None)
    name = torch.cuda.get_device_name(0)
    cap = tuple(torch.cuda.get_device_capability(0))
    has = hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")
    err = None
    if has and cap >= MIN_CAPABILITY:
        from jobs.training.fp8.matmul import probe_scaled_mm

        err = probe_scaled_mm()
    return CardInfo(name, (int(cap[0]), int(cap[1])), has, err)


def resolve_compute(configured: str, calibrated: CalibrationRecord | None, card: CardInfo) -> ComputeChoice:
    """The night's compute. "fp8" on a card that cannot is an error (the config asks the impossible);
    "auto" falls back to bf16 and says why."""
    if configured == "bf16":
        return ComputeChoice("bf16", "compute bf16 from config")
    ok, why = assess_card(card)
    if configured == "auto" and card.capability is None:  # a CPU: FP8 is no choice to explain (issue 42)
        return ComputeChoice("bf16", "compute: CPU")
    if configured == "fp8":
        if not ok:
            raise ValueError(f'[train] compute = "fp8": {why}; use "auto" (bf16 where FP8 is not possible) or "bf16"')
        return ComputeChoice("fp8", f"compute fp8 from config ({why})")
    if not ok:
        return ComputeChoice("bf16", f"compute auto -> bf16: {why}")
    if calibrated is None:
        return ComputeChoice("bf16", "compute auto -> bf16: not calibrated (`nightshift calibrate` runs the FP8 "
                                     "numerics check that auto needs)")
    if calibrated.compute != "fp8":
        why_not = calibrated.fp8_refused or "calibrated in bf16"
        return ComputeChoice("bf16", f"compute auto -> bf16: {why_not}")
    return ComputeChoice("fp8", "compute auto -> fp8: calibrated, numerics check passed")


def with_compute(shape: StepShape, cfg: TrainConfig, calibrated: CalibrationRecord | None,
                 card: CardInfo | None = None) -> StepShape:
    """The step shape with the run's compute decided (`card` is asked only when it matters)."""
    if cfg.compute == "bf16":
        choice = ComputeChoice("bf16", "compute bf16 from config")
    else:
        choice = resolve_compute(cfg.compute, calibrated, card or card_info())
    return shape.model_copy(update={"compute": choice.compute, "basis": f"{shape.basis}; {choice.reason}"})


@dataclass(frozen=True)
class CalibrationDecision:
    """What calibrate records after the FP8 check: the compute it measures, or why FP8 was refused."""

    compute: Compute
    refused: str | None  # why FP8 was refused (None: not refused, or not asked)
    error: str | None = None  # calibrate must stop: "fp8" was configured and refused


def decide_calibration(configured: str, card_ok: bool, card_why: str, numerics_passed: bool | None,
                       numerics_why: str | None) -> CalibrationDecision:
    """calibrate refuses FP8 on a card or model where the check fails, and says why. With "fp8"
    configured a refusal stops calibrate (nothing recorded); with "auto" it records bf16 and the reason."""
    if configured == "bf16":
        return CalibrationDecision("bf16", None)
    if not card_ok:
        refused = card_why
    elif not numerics_passed:
        refused = f"FP8 numerics check failed: {numerics_why or 'no result'}"
    else:
        return CalibrationDecision("fp8", None)
    if configured == "fp8":
        return CalibrationDecision("bf16", refused, error=f'refusing FP8: {refused}; set [train] compute = "auto" '
                                                         '(records bf16 and the reason) or "bf16"')
    return CalibrationDecision("bf16", refused)
