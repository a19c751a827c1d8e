# ruff: noqa  (a results script: the table of the wake runs from their nights' own logs and reports)
"""python results/h200-2026-11-26/wake-bytecode/summarise.py: wake.json and the table, from each run's
once<N>.log (the child's log lines) and report3.json (`nightshift report --json`: first_step_seconds)."""
import json, sys
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {  # run -> (folder, what differs)
    "sP": (HERE / "sP", "image as it is (no bytecode for ~3,200 modules, none written)"),
    "sQ": (HERE / "sQ", "bytecode for the wheels only (/tmp/site)"),
    "sR": (HERE / "sR", "bytecode everywhere (compileall: venv, wheels, repo)"),
    "sS": (HERE / "sS", "image as it is; inbox checked ahead (workers: a thread per CPU, not niced)"),
    "sT": (HERE.parents[1] / "h100-2026-11-26" / "wake-bytecode" / "sT", "image as it is; inbox checked ahead"),
    "sU": (HERE.parents[1] / "h100-2026-11-26" / "wake-bytecode" / "sU", "bytecode everywhere; inbox checked ahead"),
}
LEGS = ("imported", "file_ingested", "plan", "model_loaded", "first_step")


def night(log: Path) -> dict:
    first, out = None, {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        t = datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
        first = t if first is None else first
        e = d.get("event")
        if e in LEGS and e not in out:
            out[e] = {"at": round(t - first, 2), **{k: d[k] for k in ("seconds", "check_seconds", "checked_ahead")
                                                                    if k in d}}
    return out


rows = []
for run, (folder, what) in RUNS.items():
    gpu = (folder / "gpu.txt").read_text().splitlines()[1].split(",")[0]
    nights = json.loads((folder / "report3.json").read_text())["nights"]
    for n in (1, 2, 3):
        legs = night(folder / f"once{n}.log")
        rows.append({"run": run, "gpu": gpu, "setup": what, "night": n,
                     "wake_to_first_step_s": round(nights[n - 1]["first_step_seconds"], 1),
                     "imports_s": legs["imported"]["seconds"], "file_ingested_s": legs["file_ingested"]["seconds"],
                     "check_wait_s": legs["file_ingested"].get("check_seconds"),
                     "checked_ahead": legs["file_ingested"].get("checked_ahead", False),
                     "model_loaded_at_s": legs["model_loaded"]["at"], "first_step_s": legs["first_step"]["seconds"],
                     "trained_tokens": nights[n - 1]["trained_tokens"], "planned_tokens": nights[n - 1]["planned_tokens"]})
(HERE / "wake.json").write_text(json.dumps(rows, indent=1) + "\n")
print("| run | GPU | setup | night | wake -> first step s | imports s | file ingested s (check wait) | first step s |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['run']} | {r['gpu']} | {r['setup']} | {r['night']} | {r['wake_to_first_step_s']} | {r['imports_s']} | "
          f"{r['file_ingested_s']} ({r['check_wait_s']}) | {r['first_step_s']} |")
