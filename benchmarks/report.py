"""The parent's report: rows read back from the workers, ratios and MFU, a Markdown table, one JSON file.

MFU = real tok/s x 4 x matmul params / peak FLOP/s (QLoRA without recomputation: ~4 FLOPs per
weight a token meets). `mfu` is against --peak-flops (790 TFLOP/s: every row comparable); the table
shows each row against its own number format's peaks (settings.PEAKS: bf16 790 measured / 989
datasheet, FP8 1,400 measured / 1,979 datasheet), JSON `mfu_own`. "x baseline" compares with HF
transformers + PEFT on the same profile; "x_unsloth_best" (JSON only) compares ours with the best
Unsloth + TRL configuration, "x_ours_bf16" our FP8 rows with our bf16 row.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.settings import PEAKS
from daemon.tables import markdown

COLUMNS = (
    "stack", "data", "batch", "grad. ckpt", "real tok/s", "samples/h", "peak alloc / reserved GB", "W",
    "J per 1k tok", "MFU (own peak: measured / datasheet)", "x baseline", "first step s",
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def summarise(rows: list[dict[str, Any]], *, matmul: int, peak_flops: float) -> list[dict[str, Any]]:
    """Adds mfu (against `peak_flops`), mfu_989 (the bf16 datasheet's dense peak), x_baseline and (ours)
    x_unsloth_best to the rows, in place; returns them."""
    base = {r["profile"]: r.get("real_tok_s") for r in rows if r.get("stack") == "baseline"}
    for r in rows:
        tps = r.get("real_tok_s")
        if tps:
            r["mfu"] = tps * 4 * matmul / peak_flops
            r["mfu_989"] = tps * 4 * matmul / PEAKS["bf16"]["datasheet"]
            b = base.get(r.get("profile"))
            r["x_baseline"] = tps / b if b else None
    best_peer: dict[str, float] = {}
    for r in rows:
        if r.get("stack") == "trl" and r.get("real_tok_s"):
            best_peer[r["profile"]] = max(best_peer.get(r["profile"], 0.0), r["real_tok_s"])
    for r in rows:
        if r.get("stack") == "ours" and r.get("real_tok_s") and best_peer.get(r["profile"]):
            r["x_unsloth_best"] = r["real_tok_s"] / best_peer[r["profile"]]
    ours_bf16 = {r["profile"]: r["real_tok_s"] for r in rows
                 if r.get("stack") == "ours" and r.get("variant", "bf16") == "bf16" and r.get("real_tok_s")}
    for r in rows:
        tps = r.get("real_tok_s")
        if not tps or "profile" not in r:
            continue
        fmt = "fp8" if r.get("compute", "bf16") == "fp8" else "bf16"
        r["mfu_own"] = {"format": fmt, **{k: tps * 4 * matmul / v for k, v in PEAKS[fmt].items()}}
        if r.get("stack") == "ours" and fmt == "fp8" and ours_bf16.get(r["profile"]):
            r["x_ours_bf16"] = tps / ours_bf16[r["profile"]]
    return rows


def _fmt(v: Any, spec: str) -> str | None:
    return None if v is None else format(v, spec)  # None: the table's "—"


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a GitHub Markdown table (rows without a profile are not stack results)."""
    cells: list[list[Any]] = []
    for r in rows:
        if "profile" not in r:
            continue
        head = [r.get("label"), r["profile"], r.get("batch"), r.get("grad_ckpt")]
        if r.get("error"):
            cells.append([*head, f"error: {r['error'][:80]}", *[""] * (len(COLUMNS) - 5)])
            continue
        own = r.get("mfu_own")
        cells.append([
            *head,
            _fmt(r.get("real_tok_s"), ",.0f"),
            _fmt(r.get("samples_per_hour"), ",.0f"),
            f"{_fmt(r.get('peak_allocated_gb'), '.1f') or '—'} / {_fmt(r.get('peak_reserved_gb'), '.1f') or '—'}",
            _fmt(r.get("mean_power_w"), ".0f"),
            _fmt(r.get("j_per_1k_tok"), ".0f"),
            None if own is None else f"{own['format']} {100 * own['measured']:.1f} % / {100 * own['datasheet']:.1f} %",
            _fmt(r.get("x_baseline"), ".2f"),
            _fmt(r.get("first_step_s"), ".0f"),
        ])
    return markdown(COLUMNS, cells)


def numerics_table(rows: list[dict[str, Any]]) -> str:
    """The FP8 numerics check rows (stack "numerics"), one line each, as Markdown."""
    cells = []
    for r in rows:
        if r.get("stack") != "numerics":
            continue
        f, n = r.get("fp8_error") or {}, r.get("nf4_error") or {}
        cells.append([
            r.get("compute"), "passed" if r.get("passed") else "FAILED: " + "; ".join(r.get("reasons") or [])[:120],
            f"{r.get('converted')}/{r.get('layers')}", _fmt(f.get("median"), ".4f"), _fmt(f.get("max"), ".4f"),
            _fmt(n.get("median"), ".4f"), _fmt(r.get("loss_max_rel_diff"), ".4f"), r.get("loss_tolerance"),
            r.get("activations")])
    cols = ("compute", "check", "converted", "FP8 err median", "FP8 err max", "NF4 err median",
            "loss max rel diff", "loss tolerance", "activations")
    return markdown(cols, cells) if cells else ""


def gpu_info() -> dict[str, Any]:
    """The card, from nvidia-smi (a process of its own: the parent never touches CUDA)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,power.limit", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        return {"nvidia_smi": out}
    except Exception as e:
        return {"nvidia_smi_error": str(e)}


def write_result(path: Path, **doc: Any) -> dict[str, Any]:
    """The run's JSON (indented, with the time it was written); returns the document."""
    doc["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path.write_text(json.dumps(doc, indent=1, default=str))
    return doc
