"""The workloads' report: MFU against both peaks, ours against the recipe, one Markdown document.

MFU = real tok/s x FLOPs per parameter per token (4 LoRA, 6 full) x matmul params / peak, against 790
TFLOP/s (dense bf16 measured on these H100/H200 machines) and 989 TFLOP/s (the datasheet).
x publication = ours / the recipe on the workload's headline figure (for the whole-job time, the
recipe's seconds / ours), same workload, model and data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daemon.tables import markdown

if TYPE_CHECKING:
    from benchmarks.workload_table import Workload

PEAKS = {"mfu_790": 790e12, "mfu_989": 989e12}
COLUMNS = ("side", "stack", "model", "data", "batch", "grad. ckpt", "real tok/s", "samples/h", "job s",
           "peak alloc / reserved GB", "J per 1k tok", "MFU 790", "MFU 989", "x publication")


def summarise(rows: list[dict[str, Any]], *, matmul: dict[str, int]) -> list[dict[str, Any]]:
    """Adds mfu_790, mfu_989 to every measured row and x_publication to ours' rows; returns the rows."""
    from benchmarks.workload_table import WORKLOADS

    for r in rows:
        tps, params = r.get("real_tok_s"), matmul.get(r.get("arch") or "")
        if tps and params:
            for key, peak in PEAKS.items():
                r[key] = tps * r.get("flops_per_token_param", 4) * params / peak
    recipe = {(r["workload"], r.get("arch"), r.get("profile")): r for r in rows
              if r.get("side") == "publication" and not r.get("error")}
    for r in rows:
        w = WORKLOADS.get(r.get("workload", ""))
        peer = recipe.get((r.get("workload"), r.get("arch"), r.get("profile")))
        if r.get("side") != "ours" or w is None or peer is None or r.get("error"):
            continue
        mine, theirs = r.get(w.headline), peer.get(w.headline)
        if mine and theirs:
            r["x_publication"] = theirs / mine if w.headline == "job_seconds" else mine / theirs
    return rows


def _f(v: Any, spec: str) -> str | None:
    return None if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        head = [r.get("side"), r.get("label"), r.get("arch"), r.get("profile"), r.get("batch"), r.get("grad_ckpt")]
        if r.get("error"):
            cells.append([*head, f"error: {r['error'][:90]}", *[""] * (len(COLUMNS) - 7)])
            continue
        cells.append([
            *head, _f(r.get("real_tok_s"), ",.0f"), _f(r.get("samples_per_hour"), ",.0f"),
            _f(r.get("job_seconds"), ",.1f"),
            f"{_f(r.get('peak_allocated_gb'), '.1f') or '—'} / {_f(r.get('peak_reserved_gb'), '.1f') or '—'}",
            _f(r.get("j_per_1k_tok"), ".0f"),
            None if r.get("mfu_790") is None else f"{100 * r['mfu_790']:.1f}%",
            None if r.get("mfu_989") is None else f"{100 * r['mfu_989']:.1f}%",
            _f(r.get("x_publication"), ".2f"),
        ])
    return markdown(COLUMNS, cells)


def document(rows: list[dict[str, Any]], workloads: list[Workload], *, gpu: Any, when: str) -> str:
    """Per workload: the recipe, its published figure, ours, where they differ, and the measured rows."""
    out = [f"# The published runs side by side ({when})", "", f"GPU: {gpu}", ""]
    for w in workloads:
        mine = [r for r in rows if r.get("workload") == w.name]
        out += [f"## {w.title}", "", f"- publication's recipe: {w.recipe}", f"- its published figure: {w.published}",
                f"- ours: {w.ours}", "- where the recipes differ: " + "; ".join(w.differ), ""]
        out += [table(mine) if mine else "(not run)", ""]
        for r in mine:
            if r.get("job_basis"):
                out.append(f"- {r['side']} job time: {r['job_basis']}")
        out.append("")
    return "\n".join(out)
