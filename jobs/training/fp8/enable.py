"""Turn a loaded LoRA model's frozen base to FP8, checked (issue 16): the one entry point.

`enable_fp8` patches Unsloth's fused LoRA layers (jobs/training/fp8/unsloth_layers.py), self-tests each
distinct layer shape on the card, captures the projections' inputs over sample tokens, converts
every projection it can (jobs/training/fp8/convert.py) while measuring its error (numerics.py), and —
when asked (calibrate, the benchmark) — trains a learnable task from the same LoRA initialisation in
bf16 before and in FP8 after the conversion and compares the losses. A failed check with the
originals kept (calibrate) puts the bf16 base back; in a night, projections that fail stay bf16 and
the rest run FP8. Nothing here raises on the training path: any error leaves the model computing as
before (each unit is converted whole or not at all) and is reported.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from jobs.contract import FP8Numerics
from jobs.data.batching import TokenizedSample
from jobs.training.config import FP8Storage, FP8StorageChoice
from jobs.training.fp8.sample_data import data_files, sample_tokens

log = structlog.get_logger("nightshift.train")
CAPTURE_TOKENS = 1024  # tokens of the capture forward
CAPTURE_ROWS = 512  # tokens per projection kept for the per-layer errors


@dataclass(frozen=True)
class Learnable:
    """The loss comparison: `steps` packed steps of `tokens_per_step` on the bigram task, at `lr`."""

    steps: int = 30
    tokens_per_step: int = 1024  # small: the originals and FP8 weights are both held meanwhile (a 32B: 49 GB)
    lr: float = 1e-3
    seed: int = 0


@dataclass
class Fp8Outcome:
    compute: str  # what the model computes with now: "fp8" or "bf16"
    numerics: FP8Numerics | None
    patch: dict[str, Any] = field(default_factory=dict)
    conversion: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    layers: list[Any] = field(default_factory=list)  # LayerNumerics of every projection (converted or not)

    def info(self) -> dict[str, Any]:
        """For the load info / the benchmark's rows (JSON)."""
        from jobs.training.fp8.matmul import STATS

        n = self.numerics
        return {"compute": self.compute, "patch": self.patch, "conversion": self.conversion, "error": self.error,
                "numerics_passed": None if n is None else n.passed,
                "numerics_reasons": [] if n is None else n.reasons, "stats": STATS.as_dict()}


def enable_fp8(model: Any, *, device: Any, tokens: list[int], activations: str, unsloth: bool,
               keep_transposed: bool = False, storage: FP8StorageChoice = "auto", cap_gb: float | None = None,
               source_dir: Path | None = None, learnable: Learnable | None = None,
               vocab: int | None = None) -> Fp8Outcome:
    """See the module doc. `tokens`: one row of sample token ids for the capture forward; `storage` "auto" is decided
    against `cap_gb` ([gpu] max_vram_gb; None: the card's memory); `source_dir`: the checkpoint, whose bf16 weights
    (if not pre-quantised) give NF4's error next to FP8's."""
    import torch

    from jobs.training.fp8 import numerics
    from jobs.training.fp8 import unsloth_layers as fp8_unsloth
    from jobs.training.fp8.convert import Conversion, base_bytes, choose_storage, find_units, timed

    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    out = Fp8Outcome("bf16", None)
    conv: Conversion | None = None
    held: FP8Storage | None = None  # the storage `storage` came to
    cuda = str(device).startswith("cuda")
    alloc0 = torch.cuda.memory_allocated() if cuda else 0
    try:
        with timed(phases, "patch"):
            patch = fp8_unsloth.install(model) if unsloth else fp8_unsloth.PatchReport(
                "native", "PEFT's forwards call the FP8 base modules")
        out.patch = patch.as_dict()
        from jobs.training.fp8.matmul import fast_accum_forward

        out.conversion["fast_accum_forward"] = fast_accum_forward()
        units = find_units(model)
        if cap_gb is None and cuda:
            cap_gb = torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9
        held, out.conversion["storage_why"] = choose_storage(storage, units, keep_transposed=keep_transposed,
                                                             cap_gb=cap_gb)
        with timed(phases, "self_test"):
            tested = _self_test(units, unsloth, held) if cuda else {}
        out.conversion["self_test"] = {_test_name(k): v or "ok" for k, v in tested.items()}
        bad = {k: v for k, v in tested.items() if v}
        from jobs.training.fp8.selftest import signature

        for u in units:
            sig = signature(u)
            if sig in bad:
                u.route, u.why = "blocked", f"self-test: {bad[sig]}"
        capture = numerics.Capture(model, CAPTURE_ROWS)
        try:
            with timed(phases, "capture"):
                capture.run(model, tokens, device)
        except Exception as e:
            activations = f"none (capture failed: {type(e).__name__}: {e})"[:300]
            capture.x.clear()
            log.warning("fp8_capture_failed", error=activations)
        losses = None
        sample_set: list[TokenizedSample] = []
        if learnable is not None:
            sample_set = numerics.bigram_samples(vocab or 32000, learnable.steps * learnable.tokens_per_step * 2,
                                                 seed=learnable.seed)
            snap = numerics.lora_snapshot(model)
            torch.manual_seed(learnable.seed)
            with timed(phases, "learnable_bf16"):
                bf16_curve = numerics.loss_curve(model, sample_set, steps=learnable.steps,
                                                 tokens_per_step=learnable.tokens_per_step, lr=learnable.lr,
                                                 device=device)
            numerics.lora_restore(model, snap)
        source = numerics.SourceWeights(source_dir) if source_dir is not None else None
        conv = Conversion(keep_transposed=keep_transposed, storage=held, keep_originals=learnable is not None,
                          check=numerics.layer_check(capture, source))
        with timed(phases, "convert"):
            conv.run(units)
        capture.x.clear()
        out.layers = conv.layers
        if learnable is not None:
            torch.manual_seed(learnable.seed)
            with timed(phases, "learnable_fp8"):
                fp8_curve = numerics.loss_curve(model, sample_set, steps=learnable.steps,
                                                tokens_per_step=learnable.tokens_per_step, lr=learnable.lr,
                                                device=device)
            numerics.lora_restore(model, snap)
            losses = (bf16_curve, fp8_curve)
        out.numerics = numerics.summarise(conv.layers, conv.fallbacks, converted=conv.converted,
                                          activations=activations, losses=losses, seconds=time.perf_counter() - t0)
        with timed(phases, "commit_or_revert"):
            if learnable is not None and not out.numerics.passed:
                conv.revert()
            else:
                conv.commit()
        out.compute = "fp8" if conv.converted else "bf16"
    except Exception as e:  # never fail the load for FP8: what converted is consistent per unit
        out.error = f"{type(e).__name__}: {e}"[:400]
        log.warning("fp8_enable_failed", error=out.error, trace=traceback.format_exc()[-1500:])
        if conv is not None and conv.keep_originals:
            try:
                conv.revert()
            except Exception as e2:
                out.error += f"; revert failed: {e2}"
        out.compute = "fp8" if conv is not None and conv.converted else "bf16"
    out.conversion.update(converted=0 if conv is None else conv.converted,
                          fallbacks={} if conv is None else dict(conv.fallbacks),
                          keep_transposed=keep_transposed, storage=held,
                          seconds=round(time.perf_counter() - t0, 2),
                          phase_seconds=phases, convert_seconds={} if conv is None else dict(conv.seconds),
                          **base_bytes(model))
    if cuda:
        out.conversion["allocated_gb_change"] = round((torch.cuda.memory_allocated() - alloc0) / 1e9, 3)
    log.info("fp8", **{k: v for k, v in out.info().items() if k != "stats"})
    return out


def _self_test(units: list[Any], unsloth: bool, storage: FP8Storage) -> dict[tuple[Any, ...], str | None]:
    from jobs.training.fp8.selftest import test_units

    swiglu = None
    if unsloth:
        from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

        swiglu = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel)
    return test_units(units, swiglu=swiglu, storage=storage)


def enable_for_run(model: Any, tokenizer: Any, cfg: Any, *, unsloth: bool, device: str,
                   cap_gb: float | None) -> dict[str, Any]:
    """The night's FP8 (StepShape.compute == "fp8", decided from the config and calibration): per-layer
    check on the shipped sample data, no loss comparison (calibrate did it); the load info's "fp8". `cap_gb`: [gpu]
    max_vram_gb, which calibrate's check decides "auto" storage against too."""
    ids, label = sample_tokens(tokenizer, data_files(None, []), n=CAPTURE_TOKENS)
    out = enable_fp8(model, device=device, tokens=ids, activations=label, unsloth=unsloth,
                     keep_transposed=cfg.fp8_keep_transposed, storage=cfg.fp8_storage, cap_gb=cap_gb)
    info = out.info()
    if out.numerics is not None:
        info["numerics"] = out.numerics.model_dump(mode="json", exclude={"worst"})
    return info


def calibrate_fp8(loaded: Any, cfg: Any, model_path: Path, learnable: Learnable | None = None,
                  card: Any = None) -> tuple[Any, Fp8Outcome | None]:
    """calibrate's FP8 check: the card, then the numerics with the loss comparison on real sample data.
    Returns (CalibrationDecision, outcome); a refused check leaves the model in bf16."""
    from jobs.training.fp8.compute import assess_card, card_info, decide_calibration

    ok, why = assess_card(card or card_info())
    if not ok:
        log.info("fp8_refused", reason=why)
        return decide_calibration(cfg.train.compute, False, why, None, None), None
    files = data_files(cfg.eval.canary_set, [Path(s.inbox) for s in cfg.sources])
    ids, label = sample_tokens(loaded.tokenizer, files, n=CAPTURE_TOKENS)
    out = enable_fp8(loaded.model, device=loaded.device, tokens=ids, activations=label,
                     unsloth=loaded.backend == "unsloth", keep_transposed=cfg.train.fp8_keep_transposed,
                     storage=cfg.train.fp8_storage, cap_gb=cfg.gpu.max_vram_gb,
                     source_dir=model_path, learnable=learnable or Learnable(), vocab=len(loaded.tokenizer))
    n = out.numerics
    passed = out.error is None and out.compute == "fp8" and n is not None and n.passed
    reason = out.error or ("; ".join(n.reasons) if n is not None else "no numerics")
    decision = decide_calibration(cfg.train.compute, True, why, passed, reason)
    log.info("fp8_calibration", compute=decision.compute, refused=decision.refused)
    return decision, out


def _test_name(sig: tuple[Any, ...]) -> str:
    """A self-test's signature as the report names it: kind, shapes, and which projections have LoRA where not all."""
    kind, _route, shapes, with_lora = sig
    part = "" if kind == "linear" or all(with_lora) else f", LoRA on {[i for i, on in enumerate(with_lora) if on]}"
    return f"{kind} {list(shapes)}{part}"
