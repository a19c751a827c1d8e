"""The acceptance run's checks and its report: <out>/<gpu>-<date>/acceptance.json and acceptance.md.

Every check is a named verdict with its numbers, so a failure says what and by how much:
- each night stopped before its window's end (the run closed and its child gone by then);
- predicted vs actual train seconds, trained vs planned tokens, wake -> first step, per night;
- every sample trained exactly once or still pending: the ledger's trained samples per version
  equal each version's manifest, each version's steps equal its batches (none twice across the
  kill), nothing lost (trained + held out + pending = ingested);
- peak VRAM of the night (torch, in the child) and of the server, their sum under the card; the
  card's own peak (NVML, every process);
- the server answered all along, and after each promotion served the new version: the newest name
  answered by that adapter, its outputs changed from the previous version's (and, where the model
  fits a CPU, equal to PEFT's own outputs for that version, recomputed here);
- no half-written version: no temporary directory left, every version's files match its manifest.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

from benchmarks.acceptance.procs import PROMPT, Client, Ledger
from jobs.contract import RunSummary


def _check(name: str, ok: bool, detail: Any = None) -> dict[str, Any]:
    return {"check": name, "passed": bool(ok), "detail": detail}


def night_rows(nights: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, verdicts = [], []
    for n in nights:
        run = n.get("run") or {}
        s = RunSummary.model_validate_json(run["summary"]) if run.get("summary") else None
        end = n["window_end"]
        stopped_in_time = (run.get("ended_at") or 1e18) <= end and (n.get("child_last_seen_alive") or 0) <= end
        row: dict[str, Any] = {
            "night": n["night"], "key": n["key"], "status": run.get("status"), "attempts": n.get("attempts"),
            "window_seconds": round(end - n["window_start"], 1),
            "ended_before_window_end_s": round(end - run["ended_at"], 1) if run.get("ended_at") else None,
            "child_gone_before_window_end_s": round(end - n["child_last_seen_alive"], 1)
            if n.get("child_last_seen_alive") else None,
            "killed_mid_training": (n.get("kill") or {}).get("done", False),
        }
        if s is not None:
            pred, act = s.predicted_train_seconds, s.actual_train_seconds
            row.update({
                "version": s.version_name, "promoted": s.promoted, "stopped": s.stopped,
                "predicted_train_s": _r(pred), "actual_train_s": _r(act),
                "budget_error_pct": _r(100 * (act / pred - 1)) if pred and act else None,
                "planned_tokens": s.planned_tokens, "trained_tokens": s.trained_tokens,
                "trained_of_planned_pct": _r(100 * s.trained_tokens / s.planned_tokens) if s.planned_tokens else None,
                "wake_to_first_step_s": _r(s.first_step_seconds), "tokens_per_second": _r(s.tokens_per_second),
                "child_start_to_first_step_s": _r(_from_child_start(s.first_step_seconds, n.get("prewarmed"))),
                "import_before_opening_s": (n.get("prewarmed") or {}).get("import_seconds"),
                "plan_basis": s.plan_basis, "step_shape": s.step_shape.model_dump() if s.step_shape else None,
                "phase_seconds": {k: _r(v) for k, v in s.phase_seconds.items()},
                "night_peak_reserved_gb": _gb(s.gpu.peak_reserved_bytes if s.gpu else None),
                "deferred_samples": s.deferred_samples, "trained_samples": s.trained_samples,
            })
        rows.append(row)
        verdicts.append(_check(f"night {n['night']} stopped before its window's end", stopped_in_time,
                               {"run_ended_s_before": row["ended_before_window_end_s"],
                                "child_gone_s_before": row["child_gone_before_window_end_s"]}))
        verdicts.append(_check(f"night {n['night']} closed with a published version",
                               run.get("status") in ("succeeded", "rejected"), run.get("status")))
        if n["night"] > 1:
            want = "nightshift_last_run_trained_tokens"
            restored = n.get("restored_series_at_start") or []
            verdicts.append(_check(f"night {n['night']}: the last run's series were back at the daemon's start",
                                   want in restored, restored))
        if n.get("kill") is not None:
            verdicts.append(_check(f"night {n['night']}: killed mid-training, restarted, resumed",
                                   n["kill"].get("done") and run.get("status") == "succeeded"
                                   and (n.get("restored_series_after_kill") is not None), n["kill"]))
    return rows, verdicts


def samples_once(ledger: Ledger, state: Path, nights: list[dict[str, Any]]) -> list[dict[str, Any]]:
    counts = ledger.sample_counts()
    by_version = ledger.trained_by_version()
    out = []
    manifests = {}
    for v in ledger.versions():
        if v["status"] in ("promoted", "rejected") and v["manifest"]:
            manifests[int(v["version"])] = json.loads(v["manifest"])
    mismatched = {v: (by_version.get(v, 0), m["data"]["samples"]) for v, m in manifests.items()
                  if by_version.get(v, 0) != m["data"]["samples"]}
    out.append(_check("every trained sample belongs to exactly one version, as its manifest says",
                      not mismatched and sum(by_version.values()) == counts.get("trained", 0),
                      {"ledger": counts, "by_version": by_version, "mismatched": mismatched}))
    twice = {v: (m["training"].get("steps"), m["training"].get("batches_done")) for v, m in manifests.items()
             if m["training"].get("steps") != m["training"].get("batches_done")}
    out.append(_check("no batch trained twice (steps = batches done, across the kill too)", not twice,
                      twice or {v: m["training"].get("resumed_from_step") for v, m in manifests.items()}))
    dropped = sum(n.get("records_dropped", 0) for n in nights)
    known = sum(counts.values())
    out.append(_check("nothing lost: trained + held out + pending = records dropped", known == dropped,
                      {"dropped": dropped, "in_ledger": counts}))
    return out


def no_half_written(state: Path, ledger: Ledger) -> dict[str, Any]:
    from jobs.store.registry import Registry

    adapters = state / "adapters"
    tmp = [p.name for p in adapters.iterdir() if p.name.startswith(".tmp")] if adapters.is_dir() else []
    bad = {}
    reg = Registry(state)
    for v in ledger.versions():
        if v["status"] in ("promoted", "rejected"):
            try:
                reg.verify(adapters / v["name"])
            except Exception as e:
                bad[v["name"]] = str(e)
    current = reg.current()
    modes = sorted({oct(p.stat().st_mode & 0o777) for p in adapters.rglob("*")} if adapters.is_dir() else set())
    return _check("no half-written version (no temporary directory, every file matches its manifest)",
                  not tmp and not bad and current is not None,
                  {"tmp_dirs": tmp, "bad": bad, "current": current.name if current else None, "file_modes": modes})


def _version_of(served: str | None) -> str | None:
    """`acc-v0002` for the served name `acc-v0002-1a2b3c4d` (the digest tells weights apart, the version is what
    the ledger knows); a name without a digest as it is."""
    m = re.fullmatch(r"(.+-v\d+)-[0-9a-f]{8}", served or "")
    return m.group(1) if m else served


def served_versions(client: Client, rows: list[dict[str, Any]], model: Path, state: Path, mode: str,
                    verify: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    answers = client.answers
    failures = [a for a in answers if not a.ok]
    gaps = [b.t - a.t for a, b in itertools.pairwise(answers)]
    verdicts = [_check("the server answered every request all along", answers and not failures,
                       {"requests": len(answers), "failures": len(failures),
                        "first_failures": [f.error for f in failures[:3]],
                        "longest_gap_s": _r(max(gaps) if gaps else None),
                        "slowest_answer_s": _r(max((a.seconds for a in answers), default=None))})]
    digests: dict[str, set[str]] = {}
    for a in answers:
        if a.ok and a.adapter and a.digest:
            digests.setdefault(_version_of(a.adapter) or "", set()).add(a.digest)
    served = []
    previous = "base"
    for r in rows:
        name = r.get("version")
        if not r.get("promoted") or not name:
            continue
        got = [a for a in answers if _version_of(a.requested) == name]
        ok = bool(got) and all(a.ok and a.adapter == a.requested for a in got)
        changed = digests.get(name, set()).isdisjoint(digests.get(previous, set())) and bool(digests.get(name))
        stable = len(digests.get(name, set())) == 1
        entry = {"night": r["night"], "version": name, "answers": len(got), "digest": sorted(digests.get(name, set())),
                 "previous": previous, "outputs_changed": changed, "outputs_stable": stable}
        if verify:
            entry["recomputed_digest"] = recompute(model, state / "adapters" / name, mode)
            ok = ok and entry["recomputed_digest"] in digests.get(name, set())
        served.append(entry)
        verdicts.append(_check(f"after night {r['night']} the server served {name}, with its own outputs",
                               ok and changed and stable, entry))
        previous = name
    return served, verdicts


def recompute(model: Path, adapter: Path, mode: str) -> str:
    """The version's outputs computed here, independently of the server: base + PEFT on the CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.acceptance.server import logits_digest, prompt_ids

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, local_files_only=True)
    m = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        return logits_digest(m(input_ids=torch.tensor([prompt_ids(tok, PROMPT[mode])])).logits[0, -1])


def vram(rows: list[dict[str, Any]], server: dict[str, Any], card: Any) -> dict[str, Any]:
    night_peak = max((r.get("night_peak_reserved_gb") or 0 for r in rows), default=0) or None
    server_peak = _gb(server.get("peak_reserved_bytes"))
    total = _gb(card.total or server.get("total_bytes"))
    detail = {"night_peak_reserved_gb": night_peak, "server_peak_reserved_gb": server_peak,
              "server_held_gb": _gb(server.get("ballast_bytes")), "card_gb": total,
              "card_peak_used_gb_nvml": _gb(card.peak()), "sum_gb": _r((night_peak or 0) + (server_peak or 0))}
    if total is None:
        return _check("peak VRAM of night + server under the card", True, {**detail, "note": "no GPU: n/a"})
    return _check("peak VRAM of night + server under the card", detail["sum_gb"] <= total, detail)


def evaluate(*, work: Path, model: Path, nights: list[dict[str, Any]], calibration: dict[str, Any],
             client: Client, server_stats: dict[str, Any], card: Any, args: dict[str, Any], gpu: bool, mode: str,
             verify_outputs: bool) -> dict[str, Any]:
    state = work / "state"
    ledger = Ledger(state / "ledger.sqlite")
    rows, verdicts = night_rows(nights)
    verdicts += samples_once(ledger, state, nights)
    verdicts.append(no_half_written(state, ledger))
    served, v2 = served_versions(client, rows, model, state, mode, verify_outputs)
    verdicts += v2
    verdicts.append(vram(rows, server_stats or {}, card))
    if gpu:
        verdicts.append(_check("nightshift calibrate ran", calibration.get("exit") == 0,
                               calibration.get("error") or calibration.get("seconds")))
    return {"passed": all(v["passed"] for v in verdicts), "date": dt.date.today().isoformat(),
            "batching": "packed" if gpu else "padded",
            "device": card.name or "cpu", "model": str(model), "args": {k: str(v) for k, v in args.items()},
            "calibration": calibration, "nights": rows, "served": served, "server": server_stats,
            "checks": verdicts, "work": str(work)}


def write(result: dict[str, Any], out_root: Path, device: str | None) -> Path:
    slug = "cpu"
    if device:
        m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device) or re.search(r"(RTX\s*PRO\s*\d+)", device)
        slug = (m.group(1) if m else "gpu").lower().replace(" ", "")
    out = Path(out_root) / f"{slug}-{result['date']}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "acceptance.md").write_text(markdown(result))
    logs = Path(result["work"]) / "logs"
    if logs.is_dir():
        shutil.copytree(logs, out / "logs", dirs_exist_ok=True)
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Acceptance run: {r['device']}, {r['date']}", "",
             f"Model `{r['model']}`; {len(r['nights'])} windows of {r['args'].get('window_minutes')} min; "
             f"verdict: **{'PASSED' if r['passed'] else 'FAILED'}**.", ""]
    cal = r.get("calibration") or {}
    if cal.get("record"):
        rec = cal["record"]
        lines += [f"Calibrate ({cal['seconds']} s): {rec['tokens_per_step']:,} tokens/step, checkpointing "
                  f"{'on' if rec['gradient_checkpointing'] else 'off'}, "
                  + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rec["tokens_per_second"].items())
                  + f", overheads {rec.get('overhead_seconds')} s, under {rec['max_vram_gb']:.1f} GB.", ""]
    else:
        lines += [f"Calibrate: {cal.get('skipped') or cal.get('error') or 'not run'}", ""]
    head = ("| night | status | ended before window end | predicted s | actual s | budget error | planned tok | "
            "trained tok | trained/planned | wake -> first step (child start ->) | tok/s | step | night peak VRAM | "
            "served after |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    served = {s["night"]: s for s in r.get("served", [])}
    for n in r["nights"]:
        shape = n.get("step_shape") or {}
        s = served.get(n["night"], {})
        lines.append(
            f"| {n['night']}{' (killed, resumed)' if n.get('killed_mid_training') else ''} | {n.get('status')} | "
            f"{_s(n.get('ended_before_window_end_s'))} s | {_s(n.get('predicted_train_s'))} | "
            f"{_s(n.get('actual_train_s'))} | {_s(n.get('budget_error_pct'))} % | {_s(n.get('planned_tokens'))} | "
            f"{_s(n.get('trained_tokens'))} | {_s(n.get('trained_of_planned_pct'))} % | "
            f"{_s(n.get('wake_to_first_step_s'))} s ({_s(n.get('child_start_to_first_step_s'))} s) | "
            f"{_s(n.get('tokens_per_second'))} | "
            f"{_step(r, shape)} | "
            f"{_s(n.get('night_peak_reserved_gb'))} GB | {s.get('version', '—')} |")
    lines += ["", "| check | passed | detail |", "|---|---|---|"]
    for c in r["checks"]:
        detail = json.dumps(c["detail"], default=str)
        lines.append(f"| {c['check']} | {'yes' if c['passed'] else '**NO**'} | {detail[:300]} |")
    return "\n".join(lines) + "\n"


def _step(r: dict[str, Any], shape: dict[str, Any]) -> str:
    if r.get("batching") == "padded":
        return "padded"
    return f"{_s(shape.get('tokens_per_step'))}{' ckpt' if shape.get('gradient_checkpointing') else ''}"


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


def _gb(b: int | float | None) -> float | None:
    return None if b is None else round(b / 1e9, 2)


def _s(x: Any) -> str:
    if x is None:
        return "—"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _from_child_start(first_step_s: float | None, prewarmed: dict[str, Any] | None) -> float | None:
    """A child started before the opening times its first step from the opening; from its own start add
    the lead it had (its import and its wait)."""
    if first_step_s is None or not prewarmed:
        return first_step_s
    return first_step_s + max(0.0, prewarmed.get("lead_seconds", 0.0))
