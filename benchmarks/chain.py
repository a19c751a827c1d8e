"""`python -m benchmarks.chain`: does learning hold night after night? Chains of real nights on the CPU.

Each chain runs whole nights (jobs/night/run.py, in this process) on the demo's tiny model, with the
shipped config's `[plan]`, `[train]` and `[eval]` (config/nightshift.toml; only the paths change):

- `two tasks`: three nights of task A, then three of task B (benchmarks/tasks.py: the same keys,
  other answers, so forgetting shows at once): the defaults must learn B and keep A;
- `noisy`: three nights of task A, then ten of task A with 15 % of the labels wrong: the gate must
  not let the noise walk A down (issue 39: within 3 points of A's best).

After every night the adapter in service answers each task's unseen test prompts (20 per key, 240
a task), scored by exact match by an independent greedy decoder (benchmarks/greedy.py, none of the
product's evaluation code). Each chain runs `--draws` draws of the nights' data (other prompts, other
noise).

    OMP_NUM_THREADS=1 python -m benchmarks.chain --out /tmp/chain-$(date +%F) --draws 3

prints a Markdown table (exact match of A / B in service after each night; ✗ where the night was not
promoted, with what its refused candidate scored; per chain and draw) and writes chain.json there
(every night's gate checks and figures).
`--set eval.heldout_pool=128` changes one key for an experiment (recorded in chain.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks import greedy
from benchmarks.tasks import TASK_A, TASK_B, Task
from daemon.tables import markdown

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "config" / "nightshift.toml"
NOISE = 0.15
TWO_TASKS = ((TASK_A, 1), (TASK_A, 2), (TASK_A, 3), (TASK_B, 4), (TASK_B, 5), (TASK_B, 6))  # (task, night number)
NOISY = ((TASK_A, 1), (TASK_A, 2), (TASK_A, 3), *((TASK_A.noisy(NOISE), n) for n in range(4, 14)))
# night 4 brings task A's prompts with every answer wrong: the gate must reject it, its samples must come back
WRONG = ((TASK_A, 1), (TASK_A, 2), (TASK_A, 3), (TASK_A.scrambled(), 4), (TASK_B, 5), (TASK_B, 6))
SCHEDULES: dict[str, Sequence[tuple[Task, int]]] = {"two tasks": TWO_TASKS, "noisy": NOISY, "wrong night": WRONG}
SECTIONS = ("plan", "train", "eval")  # taken from the shipped config
PATH_KEYS = {"eval": ("canary_set", "regression_set")}  # relative to the config file, as the product reads them


def shipped_sections(path: Path = SHIPPED) -> dict[str, dict[str, Any]]:
    """The config file's [plan], [train] and [eval], its paths made absolute (relative to the file)."""
    raw = tomllib.loads(path.read_text())
    out = {k: dict(raw.get(k, {})) for k in SECTIONS}
    for section, keys in PATH_KEYS.items():
        for key in keys:
            if out[section].get(key) is not None:
                out[section][key] = str((path.parent / out[section][key]).resolve())
    return out


def build_model(out: Path) -> Path:
    from jobs.training.models.tiny import build_tiny_llama

    if not (out / "config.json").exists():
        build_tiny_llama(out, sorted((REPO / "config" / "sample-inbox").glob("*.json*")))
    return out


def night_config(workdir: Path, model: Path, over: dict[str, Any] | None = None,
                 sections: dict[str, dict[str, Any]] | None = None) -> Any:
    """The night's config: `sections` (default: the shipped config's), then `over` on top, key by key."""
    from jobs.night.config import NightConfig

    cfg: dict[str, Any] = {
        "state_dir": workdir / "state", "model": {"path": model, "name": "chain"},
        "sources": [{"name": "inbox", "inbox": workdir / "inbox", "settle_seconds": 0}],
        "gpu": {"enabled": False}, **(shipped_sections() if sections is None else sections),
    }
    for section, values in (over or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    (workdir / "inbox").mkdir(parents=True, exist_ok=True)
    return NightConfig.model_validate(cfg)


def run_chain(workdir: Path, model: Path, schedule: Sequence[tuple[Task, int]], *, per_night: int,
              over: dict[str, Any] | None = None, sections: dict[str, dict[str, Any]] | None = None,
              draw: int = 0, test_per_key: int = 20,
              on_night: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the nights in order; one row per night: its summary's figures, its gate's checks and each task's
    exact match (the independent greedy scorer on `test_per_key` unseen prompts per key)."""
    from jobs.night.run import run_night

    cfg = night_config(workdir, model, over, sections)
    tests = {t.name: t.test_set(test_per_key) for t in (TASK_A, TASK_B)}
    rows = []
    for i, (task, night) in enumerate(schedule):
        records = task.night(per_night, night, draw=draw, test_per_key=test_per_key)
        path = workdir / "inbox" / f"night-{i + 1:02d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        t0, c0 = time.time(), time.process_time()
        s = run_night(cfg, night=f"2026-12-{i + 1:02d}", deadline=time.time() + 3600, emit=lambda _: None,
                      stop=threading.Event())
        current = workdir / "state" / "current"
        gate = s.gate
        row = {"night": i + 1, "task": task.name, "wrong": task.wrong,
               "outcome": s.outcome.value, "promoted": s.promoted,
               "version": s.version, "trained": s.trained_samples, "replayed": s.replay_samples,
               "heldout": s.heldout_samples, "returned": s.returned_samples, "set_aside": s.set_aside_samples,
               "regression_samples": s.regression_samples, "failed": gate.failed() if gate else "",
               "checks": [c.model_dump(exclude_none=True) for c in gate.checks] if gate else [],
               "isolated": dict(s.isolated), "kl_from_service": s.kl_from_service,
               "seconds": round(time.time() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1),
               "train_loss": s.losses.train,
               "regression": {k: s.metrics.get(f"regression_{k}") for k in ("before", "after", "reference")},
               "exact_match": greedy.exact_match(model, current.resolve() if current.exists() else None, tests)}
        candidate = workdir / "state" / "adapters" / f"chain-v{s.version:04d}" if s.version else None
        if not s.promoted and candidate is not None and candidate.is_dir():  # what the gate refused: was it worse?
            row["candidate_exact_match"] = greedy.exact_match(model, candidate, tests)
        rows.append(row)
        if on_night:
            on_night(row)
    return rows


def cell(row: dict[str, Any]) -> str:
    em = row["exact_match"]
    mark = "" if row["promoted"] else " ✗"  # rejected: the adapter in service did not change
    refused = row.get("candidate_exact_match")
    if refused:
        mark += f" (refused: {refused['A'] * 100:.1f} / {refused['B'] * 100:.1f})"
    return f"{em['A'] * 100:.1f} / {em['B'] * 100:.1f}{mark}"


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    n = max(len(r) for r in results.values())
    head = ["chain", *[f"night {i + 1}" for i in range(n)], "A best → end", "B end"]
    body = []
    for name, rows in results.items():
        a = [r["exact_match"]["A"] * 100 for r in rows]
        best = max(a)
        body.append([name, *[f"{r['task']}{' ' + r['wrong'] if r.get('wrong') else ''}: {cell(r)}" for r in rows],
                     *[""] * (n - len(rows)), f"{best:.1f} → {a[-1]:.1f} ({a[-1] - best:+.1f})",
                     f"{rows[-1]['exact_match']['B'] * 100:.1f}"])
    return markdown(head, body)


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": os.getloadavg()}


def parse_set(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` (value read as JSON, else as a string) -> {section: {key: value}}."""
    over: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        section, dot, key = name.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise SystemExit(f"--set {item!r}: expected <{'|'.join(SECTIONS)}>.<key>=<value>")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        over.setdefault(section, {})[key] = parsed
    return over


def write(args: argparse.Namespace, info: dict[str, Any], sections: dict[str, Any], over: dict[str, Any],
          results: dict[str, list[dict[str, Any]]]) -> str:
    table = report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain.json").write_text(json.dumps(
        {"machine": info, "load_average_at_end": os.getloadavg(), "per_night": args.per_night,
         "config": str(args.config), "sections": sections, "set": over, "test_prompts_per_task":
         args.test_per_key * 12, "table": table, "results": results}, indent=2, default=str))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chain", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "results" / f"cpu-{date.today():%Y-%m-%d}")
    ap.add_argument("--chains", default="two tasks,noisy", help="comma-separated names of: " + ", ".join(SCHEDULES))
    ap.add_argument("--draws", type=int, default=3, help="draws of the nights' data (other prompts, other noise)")
    ap.add_argument("--first-draw", type=int, default=1)
    ap.add_argument("--per-night", type=int, default=96, help="new samples per night")
    ap.add_argument("--nights", type=int, default=0, help="only the first N nights of each chain (0: all)")
    ap.add_argument("--test-per-key", type=int, default=20, help="unseen test prompts per key (12 keys a task)")
    ap.add_argument("--config", type=Path, default=SHIPPED, help="whose [plan], [train], [eval] the nights use")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one key")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nightshift-chain"))
    ap.add_argument("--model", type=Path, default=None, help="a tiny model built already (default: built in --work)")
    args = ap.parse_args(argv)
    from jobs.runtime import logs

    logs.configure("WARNING")
    sections, over = shipped_sections(args.config), parse_set(args.set)
    model = args.model or build_model(args.work / "model")
    info = machine()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in [c.strip() for c in args.chains.split(",") if c.strip()]:
        if name not in SCHEDULES:
            raise SystemExit(f"--chains: no chain {name!r} (known: {', '.join(SCHEDULES)})")
        schedule = SCHEDULES[name][: args.nights or None]
        for draw in range(args.first_draw, args.first_draw + args.draws):
            label = f"{name}, draw {draw}"
            work = args.work / f"{name.replace(' ', '-')}-{draw}"
            if work.exists():
                import shutil

                shutil.rmtree(work)
            print(f"chain: {label}", flush=True)
            results[label] = run_chain(
                work, model, schedule, per_night=args.per_night, over=over, sections=sections, draw=draw,
                test_per_key=args.test_per_key,
                on_night=lambda r: print(f"  night {r['night']} ({r['task']} {r['wrong']}): {cell(r)} "
                                         f"{r['outcome']} {r['seconds']} s {r['failed']}", flush=True))
            write(args, info, sections, over, results)  # after every chain: a long run can be read as it goes
    table = write(args, info, sections, over, results)
    print(table)
    print(f"written: {args.out / 'chain.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
