"""The step shape of a run (tokens per step, gradient checkpointing) and the speed that shape trains at.

Config values win; "auto" takes what `nightshift calibrate` measured for this exact model, device
and config (a typed CalibrationRecord from the ledger), fitted into the memory there is *now*:

    limit = min([gpu] max_vram_gb, free VRAM now) - [gpu] headroom_gb

through the calibrated memory line (peak = static + per token x tokens). The card is shared with
an inference server, so the step shrinks when less is free than calibration assumed; checkpointing
is turned on only when not even a `max_seq_length` step fits without it.

The checkpointing line: calibrate probes it too where it can (`checkpointing_memory`, measured).
Where it could not, it is estimated from the no-checkpointing line: same static memory, a quarter of
the activations per token (full recomputation keeps only each layer's input: measured on an 8B,
16,384-token packed steps took 10.9 GB with checkpointing and 67.2 GB without, about 0.08 of the
activations; 0.25 leaves room). The basis says which.

The speed of the shape used (for the plan): measured where calibrate or an earlier night timed that
shape; else scaled, and the plan's basis says so:
- another step size with the same checkpointing: through the line seconds/step = c + tokens / r
  fitted to the sizes calibrate timed (one size: assumed equal; never faster than the fastest seen);
- checkpointing on where only off was timed: x 0.70 (measured on an 8B: 10,708 vs 15,267 tok/s;
  the product's night 11,432 vs 14,860); off where only on was timed: no speed-up assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobs.contract import CalibrationRecord, MemoryModel, ShapeRate, StepShape
from jobs.training.config import TrainConfig
from jobs.training.packing import choose_token_budget

CKPT_MEMORY_RATIO = 0.25  # activations per token with checkpointing / without (estimate, see above)
CKPT_SPEED_RATIO = 0.70  # tokens/s with checkpointing / without (estimate, see above)


def _fmt_gb(x: float) -> str:
    return f"{x:.1f} GB"


def memory_line(cal: CalibrationRecord, checkpointing: bool) -> tuple[MemoryModel | None, str]:
    """The memory model for `checkpointing` on or off, and whether it was measured or estimated."""
    if checkpointing == cal.gradient_checkpointing:
        return cal.memory, "measured"
    if not checkpointing:  # calibrate ran with checkpointing forced on: nothing known without it
        return None, "not measured"
    if cal.checkpointing_memory is not None:
        return cal.checkpointing_memory, "measured" if cal.checkpointing_measured else "estimated"
    est = MemoryModel(static_gb=cal.memory.static_gb, mb_per_token=cal.memory.mb_per_token * CKPT_MEMORY_RATIO)
    return est, f"estimated ({CKPT_MEMORY_RATIO:g} x the activations without)"


def resolve_step(cfg: TrainConfig, calibrated: CalibrationRecord | None, *, free_vram_gb: float | None = None,
                 max_vram_gb: float | None = None, headroom_gb: float = 3.0) -> StepShape:
    """The run's step shape. `free_vram_gb`: the card's free memory now (NVML; None: unknown or no
    card); `max_vram_gb`: the configured cap (None: the one calibration used)."""
    if calibrated is None:
        return _uncalibrated(cfg, free_vram_gb)
    cap = max_vram_gb or calibrated.max_vram_gb
    room = min(cap, free_vram_gb) if free_vram_gb is not None else cap
    limit = max(0.0, room - headroom_gb)
    why_limit = (f"{_fmt_gb(free_vram_gb)} free now, cap {cap:g} GB, headroom {headroom_gb:g} GB"
                 if free_vram_gb is not None else f"cap {cap:g} GB, headroom {headroom_gb:g} GB (free memory unknown)")
    want = calibrated.tokens_per_step if cfg.tokens_per_step == "auto" else int(cfg.tokens_per_step)
    gc_cfg = cfg.gradient_checkpointing
    choices = [False, True] if gc_cfg == "auto" else [bool(gc_cfg)]

    def shape(tokens: int, gc: bool, basis: str, line: MemoryModel | None) -> StepShape:
        tokens = max(int(tokens), cfg.max_seq_length)
        return StepShape(tokens_per_step=tokens, gradient_checkpointing=gc, basis=basis, free_vram_gb=free_vram_gb,
                         limit_gb=round(limit, 2), predicted_peak_gb=round(line.peak_gb(tokens), 2) if line else None)

    if cfg.tokens_per_step != "auto":  # the operator's size: kept, and said when it will not fit
        gc = choices[0] if len(choices) == 1 else _first_fitting(calibrated, want, limit)
        line, how = memory_line(calibrated, gc)
        over = line is not None and line.peak_gb(want) > limit
        basis = (f"tokens per step from config; checkpointing {'on' if gc else 'off'} "
                 f"({'config' if len(choices) == 1 else 'auto'}); memory line {how}; {why_limit}")
        if over:
            basis += f"; WARNING: predicted peak {line.peak_gb(want):.1f} GB is above {limit:.1f} GB"
        return shape(want, gc, basis, line)
    for gc in choices:
        line, how = memory_line(calibrated, gc)
        if line is None:
            continue
        fit = want if line.peak_gb(want) <= limit else choose_token_budget(
            line, max_vram_gb=limit, min_tokens=cfg.max_seq_length, max_tokens=want, headroom_gb=0.0)
        if fit is None:
            continue
        same = fit == calibrated.tokens_per_step and gc == calibrated.gradient_checkpointing
        if same:
            basis = f"calibrated under max_vram_gb={calibrated.max_vram_gb:g}; fits: {why_limit}"
        elif gc and not calibrated.gradient_checkpointing:
            basis = (f"checkpointing on: not even {cfg.max_seq_length:,} tokens fit without it in {limit:.1f} GB "
                     f"({why_limit}); {fit:,} tokens per step on the checkpointing line ({how})")
        else:
            basis = (f"shrunk from the calibrated {calibrated.tokens_per_step:,} to {fit:,} tokens per step: "
                     f"{why_limit} (calibrated under max_vram_gb={calibrated.max_vram_gb:g})")
        if gc_cfg != "auto":
            basis += "; checkpointing from config"
        return shape(fit, gc, basis, line)
    gc = choices[-1]
    line, _ = memory_line(calibrated, gc)
    return shape(cfg.max_seq_length, gc,
                 f"nothing fits in {limit:.1f} GB ({why_limit}): the smallest step ({cfg.max_seq_length:,} tokens, "
                 f"checkpointing {'on' if gc else 'off'}); an out-of-memory step is retried in halves", line)


def _first_fitting(cal: CalibrationRecord, tokens: int, limit: float) -> bool:
    """checkpointing for a fixed size under "auto": off when its line fits, else on."""
    line, _ = memory_line(cal, False)
    return not (line is not None and line.peak_gb(tokens) <= limit)


def _uncalibrated(cfg: TrainConfig, free_vram_gb: float | None) -> StepShape:
    basis = []
    tokens = cfg.tokens_per_step
    if tokens == "auto":
        tokens = cfg.max_tokens_per_batch
        basis.append("tokens per step = max_tokens_per_batch (not calibrated)")
    else:
        basis.append("tokens per step from config")
    gc = cfg.gradient_checkpointing
    if gc == "auto":
        gc = True
        basis.append("checkpointing on (not calibrated)")
    else:
        basis.append("checkpointing from config")
    if free_vram_gb is not None:
        basis.append(f"{free_vram_gb:.1f} GB free now, but no memory model to fit it (run `nightshift calibrate`)")
    return StepShape(tokens_per_step=max(int(tokens), cfg.max_seq_length), gradient_checkpointing=bool(gc),
                     basis="; ".join(basis), free_vram_gb=free_vram_gb)


# ---- the speed of a shape ---------------------------------------------------------------------------


def measured_rates(cal: CalibrationRecord) -> list[ShapeRate]:
    """Every shape calibrate timed: its chosen one (slower profile) and the extra ones."""
    main = ShapeRate(tokens_per_step=cal.tokens_per_step, gradient_checkpointing=cal.gradient_checkpointing,
                     tokens_per_second=cal.slowest_tokens_per_second)
    return [main, *cal.rates]


def length_curve(cal: CalibrationRecord | None) -> dict[float, float]:
    """Calibrate's rates by the mean tokens a sample of each timed length profile: how the speed moves with
    the data's length (the planner takes tonight's rate on it)."""
    from jobs.training.models.synthetic import PROFILES

    if cal is None:
        return {}
    return {PROFILES[p]: tps for p, tps in cal.tokens_per_second.items() if p in PROFILES and tps > 0}


def rate_for_shape(rates: Sequence[ShapeRate], tokens: int, checkpointing: bool) -> tuple[float, str, bool]:
    """(tokens/s, how it was obtained, measured?) of a shape, from timed shapes."""
    same = [r for r in rates if r.gradient_checkpointing == checkpointing]
    for r in same:
        if r.tokens_per_step == tokens:
            return r.tokens_per_second, "timed by calibrate", True
    if same:
        tps = _size_line(same, tokens)
        return tps, f"scaled from {len(same)} timed step size(s)", False
    other = [r for r in rates if r.gradient_checkpointing != checkpointing]
    if not other:
        raise ValueError("no timed shape")
    base = _size_line(other, tokens)
    if checkpointing:
        return base * CKPT_SPEED_RATIO, f"scaled x{CKPT_SPEED_RATIO:g} for checkpointing (not timed)", False
    return base, "the checkpointing rate (no speed-up assumed)", False


def _size_line(rates: Sequence[ShapeRate], tokens: int) -> float:
    """tokens/s at `tokens` per step from seconds/step = c + tokens / r through the timed sizes."""
    pts = sorted({(r.tokens_per_step, r.tokens_per_step / r.tokens_per_second) for r in rates})
    best = max(r.tokens_per_second for r in rates)
    if len(pts) < 2:
        return min(best, rates[0].tokens_per_second)
    (n0, s0), (n1, s1) = pts[0], pts[-1]
    if s1 <= s0:  # noise: a larger step was not slower; nothing to scale by
        return min(r.tokens_per_second for r in rates)
    inv_r = (s1 - s0) / (n1 - n0)  # seconds per token
    c = max(0.0, s0 - n0 * inv_r)  # seconds per step beyond the tokens
    return min(best, tokens / (c + tokens * inv_r))


def shape_of_row(row: Any) -> tuple[int, bool] | None:
    """The (tokens per step, checkpointing) a throughput row was measured with (None: not recorded)."""
    import json

    try:
        d = json.loads(row["detail"] or "{}")
    except (ValueError, TypeError):
        return None
    if row["origin"] == "calibrate":
        return int(d["tokens_per_step"]), bool(d["gradient_checkpointing"])
    if "tokens_per_step" in d and "gradient_checkpointing" in d:
        return int(d["tokens_per_step"]), bool(d["gradient_checkpointing"])
    return None


def history_for_shape(rows: Sequence[Any], shape: StepShape,
                      calibrated: CalibrationRecord | None) -> tuple[list[dict[str, Any]], str]:
    """The throughput history rows the planner should use for this run's shape, and a note for the basis.

    Rows measured at this very shape are used as they are; when there is none, every row is
    scaled to the shape (calibrate's own rows through its timed shapes, a night's rows by the
    ratio of the calibrated speeds of the two shapes, or the checkpointing ratio) and its
    origin says so. Rows that recorded no shape (older ledgers) count as this shape."""
    target = (shape.tokens_per_step, shape.gradient_checkpointing)
    rates = measured_rates(calibrated) if calibrated is not None else []
    as_dicts = [{k: r[k] for k in r.keys()} for r in rows]  # noqa: SIM118  (sqlite3.Row has no items())
    same = [d for d, r in zip(as_dicts, rows, strict=True) if shape_of_row(r) in (target, None)]
    if same:
        return same, f"measured at this shape ({shape.tokens_per_step:,} tok/step, {_ckpt(shape)})"
    out: list[dict[str, Any]] = []
    notes: set[str] = set()
    for d, r in zip(as_dicts, rows, strict=True):
        src = shape_of_row(r)
        assert src is not None
        if rates:
            to, how, _ = rate_for_shape(rates, *target)
            frm, _, _ = rate_for_shape(rates, *src)
            factor = to / frm
        else:
            factor, how = (CKPT_SPEED_RATIO if target[1] and not src[1] else 1.0), "checkpointing ratio"
        tps = float(d["tokens_per_second"]) * factor
        d.update(tokens_per_second=tps, seconds=float(d["tokens"]) / tps if tps > 0 else d["seconds"],
                 origin=f"{d['origin']} scaled x{factor:.2f}")
        notes.add(how)
        out.append(d)
    return out, (f"scaled to this shape ({shape.tokens_per_step:,} tok/step, {_ckpt(shape)}): "
                 + "; ".join(sorted(notes)))


def _ckpt(shape: StepShape) -> str:
    return "checkpointing " + ("on" if shape.gradient_checkpointing else "off")
