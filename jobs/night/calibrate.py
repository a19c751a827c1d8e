"""`nightshift calibrate`: measure our own training path on this GPU, for this model and config,
and record it in the throughput history, so the first night plans from a measurement.

Runs as a child process (`python -m jobs.night.calibrate --out DIR < night-config.json`), like the night:
the daemon's process never imports torch. It records tokens/s (the slower of the two length
profiles of the published benchmark) and the step shape it chose under `[gpu] max_vram_gb`
(tokens per step, checkpointing), which `[train] tokens_per_step = "auto"` then uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobs import plan as budget
from jobs.night.run import NightConfig, ensure_model, model_fingerprint, throughput_parts
from jobs.store.ledger import Ledger

DEFAULT_MAX_VRAM_GB = 40.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.night.calibrate")
    ap.add_argument("--out", required=True, help="folder for the benchmark's JSON")
    ap.add_argument("--seconds", type=float, default=30.0, help="timed seconds per length profile")
    args = ap.parse_args(argv)
    cfg = NightConfig.model_validate_json(sys.stdin.read())
    from jobs.training.loop import device_name, resolve_backend

    backend = resolve_backend(cfg.train)
    if backend != "unsloth":
        print("calibrate measures the GPU path: it needs CUDA and the `gpu` extra (unsloth); "
              f"here the backend would be '{backend}' on {device_name()}", file=sys.stderr)
        return 2
    model_path = ensure_model(cfg)
    key = budget.throughput_key(throughput_parts(cfg, model_fingerprint(model_path), backend, device_name()))
    from jobs.bench.cli import run

    max_vram = cfg.gpu.max_vram_gb or DEFAULT_MAX_VRAM_GB
    res = run(["calibrate", "--model", str(model_path), "--max-vram-gb", str(max_vram),
               "--state-dir", str(Path(cfg.state_dir) / "models"), "--out", args.out,
               "--lora-r", str(cfg.train.lora_rank), "--seconds", str(args.seconds)])
    tps = res.get("tokens_per_second")
    if not tps:
        print(f"calibrate: no measurement came back (exit codes {res.get('exit_codes')})", file=sys.stderr)
        return 1
    rows = [r for r in res["rows"] if r.get("real_tok_s")]
    slowest = min(rows, key=lambda r: r["real_tok_s"])  # a plan must not promise more than the worse case
    tokens, seconds = int(slowest["real_tokens"]), float(slowest["timed_seconds"])
    detail = {"tokens_per_step": res["tokens_per_step"], "gradient_checkpointing": res["gradient_checkpointing"],
              "max_vram_gb": max_vram, "profiles": [r.get("profile") for r in rows]}
    ledger = Ledger(Path(cfg.state_dir) / "ledger.sqlite")
    ledger.record_throughput(key=key, run_id=None, origin="calibrate", tokens=tokens, seconds=seconds,
                             overhead_seconds=None, detail=detail)
    ledger.close()
    print(json.dumps({"key": key, "tokens_per_second": tps, **detail}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
