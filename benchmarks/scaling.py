"""`python -m benchmarks scaling`: throughput on 1 and N GPUs, and the scaling efficiency, for two workloads.

    python -m benchmarks scaling --arch llama3.1-8b --gpus 2 --out /tmp/scaling

- ours (stacks/scaling_ours.py): the night's path (jobs.training: Unsloth NF4 on CUDA, LoRA r=--lora-r on
  all linear layers, packed rows at one token budget per card, gradients reduced by hand once per step);
- exxact (stacks/exxact.py): the published recipe of the Exxact study: HF Transformers LoRA in bf16,
  r=16 on q_proj and v_proj, sequences of 512 tokens, batch 2 per GPU, DistributedDataParallel.

Each (workload, count) runs in a torchrun group of its own (`--standalone --nproc-per-node n`), the settings
in a file (every worker shares torchrun's stdin). Efficiency = tok/s on N / (N x tok/s on 1): the same work
per card on both counts, so 100 % is perfect scaling. Published for the Exxact recipe: 96.1 % on 2x RTX PRO
6000, 96.5 % on 4x RTX PRO 4500 (ANCHORS.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.model import resolve_model
from benchmarks.report import gpu_info, read_rows, write_result
from benchmarks.settings import BenchSettings
from daemon.tables import markdown

WORKLOADS = {"ours": "scaling_ours", "exxact": "exxact"}  # row "stack" -> worker
PUBLISHED = {"exxact": "Exxact: 96.1 % (2x RTX PRO 6000), 96.5 % (4x RTX PRO 4500)"}


def command(worker: str, n: int, *, model: Path, rows: Path, settings: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "--max-restarts", "0", "-m", "benchmarks", "worker", "--stack", worker, "--model", str(model),
            "--rows", str(rows), "--settings", str(settings), "--t-launch", repr(time.time())]


def efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (workload, profile): tok/s on 1 and N, speed-up and efficiency."""
    out = []
    keys = sorted({(r["stack"], r.get("profile", "")) for r in rows if r.get("real_tok_s")})
    for stack, prof in keys:
        by_n = {int(r["gpus"]): float(r["real_tok_s"]) for r in rows
                if r["stack"] == stack and r.get("profile", "") == prof and r.get("real_tok_s")}
        one, n = by_n.get(1), max(by_n)
        line: dict[str, Any] = {"stack": stack, "profile": prof, "gpus": n, "tok_s_1": one, "tok_s_n": by_n[n]}
        if one and n > 1:
            line["speedup"] = by_n[n] / one
            line["efficiency"] = by_n[n] / (n * one)
        out.append(line)
    return out


def table(lines: list[dict[str, Any]]) -> str:
    cells = [[x["stack"], x["profile"] or "—", x["gpus"], f"{x['tok_s_1']:,.0f}" if x["tok_s_1"] else None,
              f"{x['tok_s_n']:,.0f}", f"{x['speedup']:.2f}x" if "speedup" in x else None,
              f"{100 * x['efficiency']:.1f} %" if "efficiency" in x else None, PUBLISHED.get(x["stack"], "")]
             for x in lines]
    return markdown(("workload", "data", "N", "tok/s on 1", "tok/s on N", "speed-up", "efficiency", "published"),
                    cells)


def scaling(s: BenchSettings) -> int:
    model = resolve_model(s)
    s.out.mkdir(parents=True, exist_ok=True)
    name = s.arch or model.path.name
    rows_path, settings_path = s.out / f"scaling-{name}.rows.jsonl", s.out / f"scaling-{name}.settings.json"
    rows_path.unlink(missing_ok=True)
    settings_path.write_text(s.model_dump_json())
    codes: dict[str, int | str] = {}
    for stack in s.scaling_workloads:
        for n in (1, s.gpus):
            cmd = command(WORKLOADS[stack], n, model=model.path, rows=rows_path, settings=settings_path)
            print(f"--- {stack} on {n}: {' '.join(cmd[3:])}", flush=True)
            try:
                codes[f"{stack}@{n}"] = subprocess.run(cmd, timeout=s.deadline or None, check=False).returncode
            except subprocess.TimeoutExpired:
                codes[f"{stack}@{n}"] = "timed out"
    rows = read_rows(rows_path)
    lines = efficiency(rows)
    write_result(s.out / f"scaling-{name}.json", mode="scaling", model=str(model.path), arch=s.arch, gpus=s.gpus,
                 settings=s.model_dump(mode="json"), exit_codes=codes, gpu=gpu_info(), rows=rows, scaling=lines)
    print(table(lines))
    return 0 if lines and all(c == 0 for c in codes.values()) else 1
