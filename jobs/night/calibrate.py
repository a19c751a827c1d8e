"""`nightshift calibrate`: measure our own training path on this GPU, for this model and config,
and record it for the night: `python -m jobs.night.calibrate --out DIR < night-config.json`.

A child process like the night (the daemon never imports torch), and the only process on the
card that calibrate adds: it loads the model exactly as the night does, probes memory per token,
chooses the step shape under min(`[gpu] max_vram_gb`, free VRAM now) - headroom, times packed
steps on both length profiles and at half that size, measures the overheads (load, evaluate,
publish: jobs/night/overheads.py) and the checkpointing line (the model reloaded with
checkpointing on), and stores one typed CalibrationRecord in the ledger under the night's key (with
`[train] objective = "dpo"` every probed and timed step is the preference night's, counted in its plan's units:
jobs/training/preference/probe.py). Its
stdout carries phase and progress events (JSON lines, as the night's child) for `nightshift
calibrate`'s display, then the measurement's JSON.

[distributed] With `[train] gpus` > 1 the CLI starts it through torchrun (`--config FILE`): every rank
probes its own card (under its own free memory), the step shape is the smallest any card holds, the
timed steps (both profiles, the half size, the checkpointing line) are global steps (one row per card)
and rank 0 alone emits events and records tokens/s for this count of cards under the key of that count.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from pathlib import Path
from typing import Any

from jobs.contract import (
    CalibrationRecord,
    ChildEvent,
    Emit,
    ExitCode,
    Phase,
    PhaseEvent,
    ProgressEvent,
    ShapeRate,
    StepShape,
)
from jobs.night.config import NightConfig
from jobs.night.model import ensure_model, model_fingerprint, throughput_key
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths

DEFAULT_MAX_VRAM_GB = 40.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.calibrate")
    ap.add_argument("--out", required=True, help="folder for the measurement's JSON")
    ap.add_argument("--seconds", type=float, default=30.0, help="timed seconds per length profile")
    ap.add_argument("--no-checkpointing-line", action="store_true",
                    help="do not reload the model to measure the checkpointing line (the night estimates it)")
    ap.add_argument("--config", help="the night's config (JSON); default: stdin")
    args = ap.parse_args(argv)
    cfg = NightConfig.model_validate_json(Path(args.config).read_text() if args.config else sys.stdin.read())
    from jobs.training.load import device_name, resolve_backend
    from jobs.training.ranks.collectives import bind_device, die_with_parent, init_group, launched

    if launched():
        die_with_parent()
        bind_device()
    backend = resolve_backend(cfg.train)
    if backend != "unsloth":
        print("calibrate measures the GPU path: it needs CUDA and the `gpu` extra (unsloth); "
              f"here the backend would be '{backend}' on {device_name()}", file=sys.stderr)
        return ExitCode.USAGE
    group = init_group(cfg.train.distributed)
    try:
        model_path = ensure_model(cfg)
        key = throughput_key(cfg, model_fingerprint(model_path), backend, device_name(), gpus=group.world)
        try:
            record, slowest = measure(cfg, model_path, seconds=args.seconds,
                                      checkpointing_line=not args.no_checkpointing_line,
                                      emit=_emit if group.is_owner else lambda _: None, group=group)
        except ValueError as e:
            print(f"calibrate: {e}", file=sys.stderr)
            return ExitCode.FAILED
        if not group.is_owner:
            return ExitCode.OK
    finally:
        group.close()
    ledger = Ledger(StatePaths(cfg.state_dir).ledger)
    try:
        ledger.record_calibration(key, record, tokens=slowest.tokens, seconds=slowest.seconds)
    finally:
        ledger.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"key": key, **record.model_dump(mode="json")}
    (out / "calibration.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return ExitCode.OK


def _emit(ev: ChildEvent) -> None:
    print(ev.model_dump_json(), flush=True)


def measure(cfg: NightConfig, model_path: Path, *, seconds: float, checkpointing_line: bool = True,
            emit: Emit = lambda _: None, group: Any = None):  # -> (CalibrationRecord, Throughput)
    """Probe and time our path under min([gpu] max_vram_gb, free VRAM now) - headroom: a card shared
    with an inference server is the use this is for (a probe beside another process once went out
    of memory on the configured cap alone). Then the overheads, a half-size step, and the
    checkpointing line (reloaded with checkpointing on), so the night can shrink its step honestly.
    `group` (jobs.training.ranks.collectives): the ranks measured together (None: one process)."""
    import dataclasses
    import gc as pygc
    import time

    import torch

    from jobs.gpu.telemetry import free_vram_gb, torch_device_uuid
    from jobs.night.overheads import measure_overheads
    from jobs.training.load import device_name, load_for_training
    from jobs.training.models.synthetic import PROFILES, make_samples
    from jobs.training.optim import build_optimizer
    from jobs.training.preference.probe import PairObjective
    from jobs.training.probe import (
        PROCESS_WARMUP_SECONDS,
        ProbeSettings,
        calibration_record,
        probe_memory,
        probe_samples,
        time_profiles,
        timed_steps,
    )
    from jobs.training.ranks.collectives import SOLO

    t = cfg.train
    cap = cfg.gpu.max_vram_gb or DEFAULT_MAX_VRAM_GB
    free = free_vram_gb(torch_device_uuid() or cfg.gpu.device)  # before anything of ours is on the card
    max_vram = min(cap, free) if free is not None else cap
    print(f"calibrate: cap {cap:g} GB, free now {free if free is None else round(free, 1)} GB: probing under "
          f"{max_vram:.1f} GB - {cfg.gpu.headroom_gb:g} GB headroom", file=sys.stderr, flush=True)
    gc = t.gradient_checkpointing if isinstance(t.gradient_checkpointing, bool) else False  # auto: off if it fits
    settings = ProbeSettings(max_vram_gb=max_vram, min_tokens=t.max_seq_length, headroom_gb=cfg.gpu.headroom_gb)
    shape = StepShape(tokens_per_step=settings.max_tokens, gradient_checkpointing=gc, basis="calibration")
    t0 = time.perf_counter()
    emit(PhaseEvent(phase=Phase.load, state="start"))
    loaded = load_for_training(model_path, t, adapter=None, shape=shape, cache_dir=StatePaths(cfg.state_dir).models,
                               max_vram_gb=max_vram)
    load_seconds = time.perf_counter() - t0
    fp8 = decision = None
    if t.compute != "bf16":  # issue 16: the FP8 check decides what is measured (refused: says why)
        from jobs.training.fp8.enable import calibrate_fp8

        decision, fp8 = calibrate_fp8(loaded, cfg, model_path)
        if decision.error:
            raise ValueError(decision.error)
    emit(PhaseEvent(phase=Phase.load, state="end", seconds=load_seconds))
    t0 = time.perf_counter()
    emit(PhaseEvent(phase=Phase.train, state="start"))
    vocab, cap_len = len(loaded.tokenizer), min(t.max_seq_length, 2048)
    # [train] objective = "dpo": the preference night's steps, optimizer and tokens (jobs/training/preference/probe.py)
    objective = PairObjective.of(t)
    optimizer = (objective.optimizer(loaded.model) if objective is not None  # the night's, by method
                 else build_optimizer(loaded.model, t, loaded.optim, device=loaded.device))
    probe = probe_memory(loaded.model, probe_samples(settings, vocab=vocab, cap=cap_len), settings, optimizer,
                         objective=objective)
    group = group or SOLO
    together = group if group.world > 1 else None  # timed steps: one row per rank, the end decided together
    agreed = group.smallest(probe.tokens_per_step or 0)  # [distributed] the step every card holds
    if not agreed:
        raise ValueError(nothing_fits(max_vram, t, decision, None if fp8 is None else fp8.conversion.get("storage")))
    probe = dataclasses.replace(probe, tokens_per_step=agreed)
    budget = agreed
    profiles = list(PROFILES)

    def progress(i: int, p: str, rates: dict) -> None:  # a profile at a time, each about `seconds` long
        emit(ProgressEvent(fraction=i / len(profiles), eta=time.time() + (len(profiles) - i) * seconds
                           + (0.0 if i else PROCESS_WARMUP_SECONDS),
                           tokens_per_second=rates[profiles[i - 1]].tokens_per_second if i else 0.0))

    # the benchmark's `ours` rows measure through the same time_profiles (issue 44: one way to measure)
    rates = time_profiles(loaded.model, optimizer, budget, profiles, vocab=vocab, cap=cap_len, seconds=seconds,
                          group=together, before=progress, objective=objective)
    for p, r in rates.items():
        if r.stalls:  # a one-off (compile, autotune) inside the window: said, not counted in the rate
            print(f"calibrate: {p}: {r.stalls} of {r.steps} timed steps stalled, "
                  f"{r.stall_seconds:.2f} s beyond the median rate, left out", file=sys.stderr, flush=True)
    emit(ProgressEvent(fraction=1.0, tokens_per_second=min(r.tokens_per_second for r in rates.values())))
    slow = min(rates, key=lambda p: rates[p].tokens_per_second)
    extra: list[ShapeRate] = []
    half = max(t.max_seq_length, budget // 2 // 256 * 256)
    if half < budget:  # a second size: the night's smaller steps are predicted through both
        r = timed_steps(loaded.model, make_samples(slow, 40 * half * group.world, vocab=vocab, cap=cap_len, seed=2),
                        half, optimizer, seconds=max(3.0, seconds / 3), group=together, objective=objective)
        extra.append(ShapeRate(tokens_per_step=half, gradient_checkpointing=gc, tokens_per_second=r.tokens_per_second))
    overheads = measure_overheads(loaded, cfg, load_seconds=load_seconds, vocab=vocab, cap=cap_len)
    emit(PhaseEvent(phase=Phase.train, state="end", seconds=time.perf_counter() - t0))
    versions = {p: md.version(p) for p in ("torch", "transformers", "peft", "unsloth") if _installed(p)}
    record = calibration_record(probe, rates, gradient_checkpointing=gc, max_vram_gb=max_vram, device=device_name(),
                                versions=versions)
    update: dict = {"overhead_seconds": overheads["total"], "overhead_detail": overheads}
    if decision is not None:
        update.update(compute=decision.compute, fp8_refused=decision.refused,
                      numerics=None if fp8 is None else fp8.numerics)
    del loaded, optimizer
    pygc.collect()
    torch.cuda.empty_cache()
    if not gc and checkpointing_line:
        try:
            line, rate = _checkpointing_line(cfg, model_path, settings, slow, seconds=max(3.0, seconds / 3),
                                             group=group)
            update.update(checkpointing_memory=line, checkpointing_measured=True)
            extra.append(rate)
        except Exception as e:  # the night then estimates it (jobs/training/shape.py) and says so
            print(f"calibrate: the checkpointing line could not be measured ({type(e).__name__}: {e}); "
                  "the night will estimate it", file=sys.stderr, flush=True)
    record = record.model_copy(update={**update, "rates": extra})
    return CalibrationRecord.model_validate(record.model_dump()), rates[slow]


def nothing_fits(max_vram: float, t: Any, decision: Any, storage: str | None) -> str:
    """What to do when not even a `max_seq_length` step fits: with FP8 as an e4m3 copy (`storage`, what the check
    held the bases in) of a 4-bit base, keeping the base in NF4 (`fp8_storage = "nf4"`) is one more way, which frees
    ~0.5 bytes a parameter."""
    copy = decision is not None and decision.compute == "fp8" and storage == "fp8" and t.quantized_base
    return (f"nothing fits under {max_vram:.1f} GB without checkpointing: set [train] gradient_checkpointing = true "
            "(or free the card / raise [gpu] max_vram_gb"
            + (', or keep the FP8 base in 4 bits: [train] fp8_storage = "nf4"' if copy else "")
            + ") and calibrate again")


def _checkpointing_line(cfg: NightConfig, model_path: Path, settings, profile: str, *, seconds: float, group: Any):
    """The model again with checkpointing on: its memory line and its speed at the size that line allows.
    [distributed] Each rank loads and probes its own card; if any rank could not, none measures the line."""
    import gc as pygc

    import torch

    from jobs.training.load import load_for_training
    from jobs.training.models.synthetic import make_samples
    from jobs.training.optim import build_optimizer
    from jobs.training.preference.probe import PairObjective
    from jobs.training.probe import probe_memory, timed_steps

    t = cfg.train
    shape = StepShape(tokens_per_step=settings.max_tokens, gradient_checkpointing=True, basis="calibration")
    loaded = probe = optimizer = None
    failed: Exception | None = None
    try:
        try:
            loaded = load_for_training(model_path, t, adapter=None, shape=shape,
                                       cache_dir=StatePaths(cfg.state_dir).models, max_vram_gb=settings.max_vram_gb)
            vocab, cap_len = len(loaded.tokenizer), min(t.max_seq_length, 2048)
            objective = PairObjective.of(t)  # a preference night's steps (jobs/training/preference/probe.py)
            optimizer = (objective.optimizer(loaded.model) if objective is not None
                         else build_optimizer(loaded.model, t, loaded.optim, device=loaded.device))
            probe = probe_memory(loaded.model, make_samples("wiki", 8 * settings.probe_tokens, vocab=vocab,
                                                            cap=cap_len), settings, optimizer, objective=objective)
        except Exception as e:  # said by the caller; the other ranks must hear of it before the next collective
            failed = e
        if group.agree(failed is not None)[0]:
            raise failed or RuntimeError("another rank could not measure it")
        assert loaded is not None and probe is not None
        tokens = group.smallest(probe.tokens_per_step or t.max_seq_length)  # [distributed] what every card holds
        data = make_samples(profile, 40 * tokens * group.world, vocab=vocab, cap=cap_len, seed=3)
        r = timed_steps(loaded.model, data, tokens, optimizer, seconds=seconds,
                        group=group if group.world > 1 else None, objective=objective)
        return probe.memory, ShapeRate(tokens_per_step=tokens, gradient_checkpointing=True,
                                       tokens_per_second=r.tokens_per_second)
    finally:
        del loaded, optimizer
        pygc.collect()
        torch.cuda.empty_cache()


def _installed(pkg: str) -> bool:
    try:
        md.version(pkg)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
