"""`python -m benchmarks workloads`: the four published fine-tuning runs nightshift is built from, each run the
publication's way and ours on this GPU in one run, side by side.

    python -m benchmarks workloads --quick --out DIR --state-dir S      (every workload's key rows, ~8 min, H200)
    ... --compute bf16,fp8      (ours also with the frozen base on FP8, each beside the same recipe run)

Models are random-initialised from the real configs (jobs/training/models/architectures.py) and built once per
run: Llama-3.1-8B in bf16 (exxact, alpaca, full; Llama-3-8B has the same shapes), Qwen3-8B / Qwen3-32B
directly as NF4 (fixstars). Data are random tokens with the workloads' lengths. Each side runs in its own
worker process (benchmarks/stacks/w_*.py); the report (workload_report.py) puts ours beside the recipe:
tok/s, samples/h or the whole job's seconds, peak memory, J per 1k tokens, MFU against 790 and 989 TFLOP/s,
and the ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.settings import BenchSettings
from benchmarks.workload_table import WORKLOADS


@dataclass(frozen=True)
class Spawn:
    stack: str
    arch: str
    build_4bit: bool
    update: dict[str, Any] = field(default_factory=dict)


def plan(s: BenchSettings) -> list[Spawn]:
    """The worker processes (a --deadline skips the last ones): the 8B's LoRA workloads, the first
    Fixstars model, full fine-tuning (the longest loads), then any further Fixstars model (the 32B)."""
    out: list[Spawn] = []

    def ours(stack: str, arch: str, build_4bit: bool, update: dict[str, Any] | None = None) -> list[Spawn]:
        """One worker per `--compute` (issue 16: the frozen base in bf16 or FP8), each beside the same recipe."""
        return [Spawn(stack, arch, build_4bit, {**(update or {}), **({"ours_compute": c} if c != "bf16" else {})})
                for c in s.compute]

    if {"exxact", "alpaca"} & set(s.workloads):
        out += [Spawn("w_hf", s.llama_arch, False), *ours("w_ours_lora", s.llama_arch, False)]
    fixstars = []
    if "fixstars" in s.workloads:
        for arch in s.fixstars_archs:
            cap = 72.0 if "32b" in arch and s.max_vram_gb == 40.0 else s.max_vram_gb
            fixstars.append([Spawn("w_fixstars", arch, True), *ours("w_ours_qlora", arch, True, {"max_vram_gb": cap})])
    out += fixstars[0] if fixstars else []
    if "full" in s.workloads:
        out += [Spawn("w_ours_full", s.llama_arch, False), Spawn("w_full", s.llama_arch, False)]
    return out + [sp for pair in fixstars[1:] for sp in pair]


def run_workloads(s: BenchSettings) -> int:
    from benchmarks.measure import smi_log
    from benchmarks.model import resolve_model
    from benchmarks.report import gpu_info, read_rows, write_result
    from benchmarks.spawn import spawn
    from benchmarks.workload_report import document, summarise

    s.out.mkdir(parents=True, exist_ok=True)
    rows_path = s.out / "workloads.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    matmul: dict[str, int] = {}
    codes: dict[str, int | str] = {}
    t0 = time.time()
    with smi_log(s.smi_log, s.smi_fields):
        for sp in plan(s):
            left = s.deadline - (time.time() - t0) if s.deadline else 3600
            key = ":".join([sp.stack, sp.arch, *([sp.update["ours_compute"]] if "ours_compute" in sp.update else [])])
            if left < 45:
                codes[key] = "skipped: no time left"
                continue
            ws = s.model_copy(update={"model": None, "arch": sp.arch, "build_4bit": sp.build_4bit, **sp.update})
            model = resolve_model(ws)  # built once: later spawns find its marker
            matmul[sp.arch] = model.matmul_params
            left = s.deadline - (time.time() - t0) if s.deadline else 3600
            codes[key] = spawn(sp.stack, ws, model.path, rows_path, max(30.0, left))
            if sp.stack == "w_ours_full" and s.full_ckpt == "auto" and _needs_ckpt(read_rows(rows_path)):
                codes[key + ":ckpt"] = spawn(sp.stack, ws.model_copy(update={"full_ckpt": "on"}), model.path,
                                             rows_path, max(30.0, s.deadline - (time.time() - t0) if s.deadline
                                                            else 3600))
    rows = summarise(read_rows(rows_path), matmul=matmul)
    doc = write_result(s.out / "workloads.json", mode="workloads", matmul_params=matmul, exit_codes=codes,
                       gpu=gpu_info(), settings=s.model_dump(mode="json"), seconds=round(time.time() - t0, 1),
                       rows=rows)
    text = document(rows, [WORKLOADS[w] for w in s.workloads], gpu=doc["gpu"], when=doc["when"])
    (s.out / "workloads.md").write_text(text)
    print(text)
    return 0 if rows else 1


def _needs_ckpt(rows: list[dict[str, Any]]) -> bool:
    """Ours' full fine-tuning found no step that fits without checkpointing (the parent then retries with it)."""
    ours = [r for r in rows if r.get("workload") == "full" and r.get("side") == "ours"]
    return bool(ours) and all("not even" in str(r.get("error", "")) for r in ours)
