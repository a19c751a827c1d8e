"""`nightshift calibrate`: measure our own training path on this GPU, for this model and config,
and record it for the night: `python -m jobs.night.calibrate --out DIR < night-config.json`.

A child process like the night (the daemon never imports torch), and the only process on the
card that calibrate adds: it loads the model exactly as the night does, probes memory per token,
chooses the step shape under `[gpu] max_vram_gb`, times packed steps on both length profiles and
stores one typed CalibrationRecord in the ledger under the night's throughput key.

[distributed] With `[train] gpus` > 1 the CLI starts it through torchrun (`--config FILE`): every rank
probes its own card, the step shape is the smallest any card holds, the timed steps are global steps
(one row per card) and rank 0 records tokens/s for this count of cards under the key of that count.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from pathlib import Path
from typing import Any

from jobs.contract import ExitCode, StepShape
from jobs.night.config import NightConfig
from jobs.night.model import ensure_model, model_fingerprint, throughput_key
from jobs.store.ledger import Ledger

DEFAULT_MAX_VRAM_GB = 40.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.calibrate")
    ap.add_argument("--out", required=True, help="folder for the measurement's JSON")
    ap.add_argument("--seconds", type=float, default=30.0, help="timed seconds per length profile")
    ap.add_argument("--config", help="the night's config (JSON); default: stdin")
    args = ap.parse_args(argv)
    cfg = NightConfig.model_validate_json(Path(args.config).read_text() if args.config else sys.stdin.read())
    from jobs.training.distributed import bind_device, die_with_parent, init_group, launched
    from jobs.training.load import device_name, resolve_backend

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
            record, slowest = measure(cfg, model_path, seconds=args.seconds, group=group)
        except ValueError as e:
            print(f"calibrate: {e}", file=sys.stderr)
            return ExitCode.FAILED
        if not group.is_owner:
            return ExitCode.OK
    finally:
        group.close()
    ledger = Ledger(Path(cfg.state_dir) / "ledger.sqlite")
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


def measure(cfg: NightConfig, model_path: Path, *, seconds: float, group: Any = None):
    """-> (CalibrationRecord, Throughput of the slower profile). `group`: the ranks measured together."""
    import dataclasses

    from jobs.training.distributed import SOLO
    from jobs.training.load import device_name, load_for_training
    from jobs.training.probe import ProbeSettings, calibration_record, probe_memory, timed_steps
    from jobs.training.step import make_optimizer
    from jobs.training.synthetic import PROFILES, make_samples

    t = cfg.train
    max_vram = cfg.gpu.max_vram_gb or DEFAULT_MAX_VRAM_GB
    gc = t.gradient_checkpointing if isinstance(t.gradient_checkpointing, bool) else False  # auto: off if it fits
    settings = ProbeSettings(max_vram_gb=max_vram, min_tokens=t.max_seq_length)
    shape = StepShape(tokens_per_step=settings.max_tokens, gradient_checkpointing=gc, basis="calibration")
    loaded = load_for_training(model_path, t, adapter=None, shape=shape, cache_dir=Path(cfg.state_dir) / "models")
    vocab, cap = len(loaded.tokenizer), min(t.max_seq_length, 2048)
    optimizer = make_optimizer(loaded.model, lr=t.learning_rate)
    probe = probe_memory(loaded.model, make_samples("wiki", 8 * settings.probe_tokens, vocab=vocab, cap=cap),
                         settings, optimizer)
    group = group or SOLO
    agreed = group.smallest(probe.tokens_per_step or 0)  # [distributed] the step every card holds
    if not agreed:
        raise ValueError(f"nothing fits under max_vram_gb={max_vram:g} without checkpointing: set [train] "
                         "gradient_checkpointing = true (or raise [gpu] max_vram_gb) and calibrate again")
    probe = dataclasses.replace(probe, tokens_per_step=agreed)
    rates = {p: timed_steps(loaded.model, make_samples(p, 40 * agreed * group.world, vocab=vocab, cap=cap, seed=1),
                            agreed, optimizer, seconds=seconds, group=group if group.world > 1 else None)
             for p in PROFILES}
    versions = {p: md.version(p) for p in ("torch", "transformers", "peft", "unsloth") if _installed(p)}
    record = calibration_record(probe, rates, gradient_checkpointing=gc, max_vram_gb=max_vram, device=device_name(),
                                versions=versions)
    return record, min(rates.values(), key=lambda r: r.tokens_per_second)


def _installed(pkg: str) -> bool:
    try:
        md.version(pkg)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
