"""`python -m benchmarks.chain`: does learning hold night after night? A chain of real nights on the CPU.

Each chain runs whole nights (jobs/night/run.py, in this process) on the demo's tiny model: three
nights of task A, then three of task B (benchmarks/tasks.py: the same keys, other answers, so
forgetting shows at once). After every night the adapter in service answers both tasks' fixed test
sets, scored by exact match. Chains differ only in `[plan] replay_share` and the gate; every other
setting is the default, the training settings are the demo's (config/nightshift.toml) at a higher
learning rate so that a task is learned in three small nights.

    python -m benchmarks.chain --out /tmp/chain-$(date +%F)

prints a Markdown table (exact match per task per night) and writes chain.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.tasks import TASK_A, TASK_B, Task
from daemon.tables import markdown

REPO = Path(__file__).resolve().parents[1]
TRAIN = {"backend": "hf", "lora_rank": 8, "lora_alpha": 16, "learning_rate": 2e-3, "epochs": 3, "batching": "padded",
         "batch_size": 16, "max_tokens_per_batch": 4096, "max_seq_length": 64, "gradient_checkpointing": False}
AB = ((TASK_A, 1), (TASK_A, 2), (TASK_A, 3), (TASK_B, 4), (TASK_B, 5), (TASK_B, 6))  # (task, night number)
# night 4 brings task A's prompts with every answer wrong: the gate must reject it, its samples must come back
WRONG = ((TASK_A, 1), (TASK_A, 2), (TASK_A, 3), (TASK_A.scrambled(), 4), (TASK_B, 5), (TASK_B, 6))
SCHEDULES = {"wrong labels on night 4 (defaults)": WRONG}
CHAINS: dict[str, dict[str, Any]] = {  # name -> config overrides; "gate": [] turns the gate off
    "no replay nor gate": {"plan": {"replay_share": 0.0}, "eval": {"gate": []}},
    "replay 0.1 without gate": {"plan": {"replay_share": 0.1}, "eval": {"gate": []}},
    "replay 0.3 without gate": {"plan": {"replay_share": 0.3}, "eval": {"gate": []}},
    "replay 0.5 without gate": {"eval": {"gate": []}},
    "no replay": {"plan": {"replay_share": 0.0}},
    "replay 0.1": {"plan": {"replay_share": 0.1}},
    "replay 0.3": {"plan": {"replay_share": 0.3}},
    "replay 0.5 (default)": {},
    "wrong labels on night 4 (defaults)": {},
}


def build_model(out: Path) -> Path:
    from jobs.training.models.tiny import build_tiny_llama

    if not (out / "config.json").exists():
        build_tiny_llama(out, sorted((REPO / "config" / "sample-inbox").glob("*.json*")))
    return out


def night_config(workdir: Path, model: Path, over: dict[str, Any] | None = None) -> Any:
    from jobs.night.config import NightConfig

    cfg: dict[str, Any] = {
        "state_dir": workdir / "state", "model": {"path": model, "name": "chain"},
        "sources": [{"name": "inbox", "inbox": workdir / "inbox", "settle_seconds": 0}],
        "plan": {"prior_tokens_per_second": 1e6, "prior_overhead_seconds": 0}, "train": dict(TRAIN),
        "gpu": {"enabled": False},
    }
    for section, values in (over or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    (workdir / "inbox").mkdir(parents=True, exist_ok=True)
    return NightConfig.model_validate(cfg)


def exact_match(model: Path, adapter: Path | None, tasks: Sequence[Task]) -> dict[str, float]:
    """Each task's exact match on its fixed test set, under the base model plus `adapter`."""
    from jobs.contract import StepShape
    from jobs.data.render import tokenize_record
    from jobs.learning import evaluate
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    loaded = load_for_training(model, TrainConfig(**TRAIN), adapter=adapter,
                               shape=StepShape(tokens_per_step=4096, gradient_checkpointing=False, basis="chain"))
    out = {}
    for task in tasks:
        samples = [tokenize_record(loaded.tokenizer, i, r, max_seq_length=64) for i, r in enumerate(task.test_set())]
        m = evaluate.eval_metrics(loaded.model, samples, pad_id=loaded.tokenizer.pad_token_id, device=loaded.device,
                                  max_tokens_per_batch=8192)
        out[task.name] = round(m["exact_match"], 4) if m else 0.0
    return out


def run_chain(workdir: Path, model: Path, schedule: Sequence[tuple[Task, int]], *, per_night: int,
              over: dict[str, Any] | None = None,
              on_night: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the nights in order; one row per night: its summary's figures and both tasks' exact match."""
    from jobs.night.run import run_night

    cfg = night_config(workdir, model, over)
    rows = []
    for i, (task, night) in enumerate(schedule):
        records = task.night(per_night, night)
        path = workdir / "inbox" / f"night-{i + 1:02d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        t0, c0 = time.time(), time.process_time()
        s = run_night(cfg, night=f"2026-12-{i + 1:02d}", deadline=time.time() + 3600, emit=lambda _: None,
                      stop=threading.Event())
        current = workdir / "state" / "current"
        gate = s.gate
        row = {"night": i + 1, "task": task.name, "wrong": task.codes != (TASK_A if task.name == "A" else TASK_B).codes,
               "outcome": s.outcome.value, "promoted": s.promoted,
               "version": s.version, "trained": s.trained_samples, "replayed": s.replay_samples,
               "heldout": s.heldout_samples, "returned": s.returned_samples, "set_aside": s.set_aside_samples,
               "regression_samples": s.regression_samples, "failed": gate.failed() if gate else "",
               "isolated": dict(s.isolated), "kl_from_service": s.kl_from_service,
               "seconds": round(time.time() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1),
               "train_loss": s.losses.train,
               "regression": {k: s.metrics.get(f"regression_{k}") for k in ("before", "after", "reference")},
               "exact_match": exact_match(model, current if current.exists() else None, (TASK_A, TASK_B))}
        rows.append(row)
        if on_night:
            on_night(row)
    return rows


def cell(row: dict[str, Any]) -> str:
    em = row["exact_match"]
    mark = "" if row["promoted"] else " ✗"  # rejected: the adapter in service did not change
    return f"{em['A'] * 100:.0f} / {em['B'] * 100:.0f}{mark}"


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    n = max(len(r) for r in results.values())
    head = ["chain", *[f"night {i + 1}" for i in range(n)]]
    label = {True: " wrong", False: ""}
    return markdown(head, [[name, *[f"{r['task']}{label[bool(r.get('wrong'))]}: {cell(r)}" for r in rows]]
                           for name, rows in results.items()])


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": os.getloadavg()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chain", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "results" / f"cpu-{date.today():%Y-%m-%d}")
    ap.add_argument("--per-night", type=int, default=96, help="new samples per night")
    ap.add_argument("--chains", default=",".join(CHAINS), help="comma-separated names of: " + ", ".join(CHAINS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/nightshift-chain"))
    args = ap.parse_args(argv)
    from jobs.runtime import logs

    logs.configure("WARNING")
    model = build_model(args.work / "model")
    info = machine()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in [c.strip() for c in args.chains.split(",") if c.strip()]:
        work = args.work / name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
        if work.exists():
            import shutil

            shutil.rmtree(work)
        print(f"chain: {name}", flush=True)
        results[name] = run_chain(work, model, SCHEDULES.get(name, AB), per_night=args.per_night, over=CHAINS[name],
                                  on_night=lambda r: print(f"  night {r['night']} ({r['task']}): {cell(r)} "
                                                           f"{r['outcome']} {r['seconds']} s", flush=True))
    table = report(results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain.json").write_text(json.dumps(
        {"machine": info, "per_night": args.per_night, "train": TRAIN, "chains": CHAINS, "table": table,
         "results": results}, indent=2, default=str))
    print(f"written: {args.out / 'chain.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
