"""A realistic night as the daemon sees it: the child's events and its RunSummary, typed by the contract.

Shared by tests/test_metrics.py and tests/test_deploy_prometheus.py, so the exposition
that promtool lints and the names the dashboard/rules are checked against come from
the same feed. The events are written as the JSON lines the child sends and read back
through `parse_event`, as the supervisor reads the pipe.
"""

from __future__ import annotations

import json
from typing import Any

from jobs.contract import ChildEvent, GpuEvent, HotswapEvent, HotswapOutcome, RunSummary, parse_event

T0 = 1_795_000_000.0  # a night's start (unix seconds)
GIB = 1 << 30


def summary(**over: Any) -> RunSummary:
    s: dict[str, Any] = {
        "run_id": "2026-11-21-a1b2c3",
        "night": "2026-11-21",
        "outcome": "succeeded",
        "version": 3,
        "version_name": "tiny-v0003",
        "promoted": True,
        "parent_version": 2,
        "files_ingested": 4,
        "ingested": {"inbox": 120, "support": 30},
        "duplicates": 5,
        "quarantined": {"invalid_json": 2, "too_long": 1},
        "trained_samples": 135,
        "trained_tokens": 54_000,
        "replay_samples": 0,
        "deferred_samples": 10,
        "backlog_samples": 10,
        "backlog_tokens": 4_000,
        "steps": 17,
        "tokens_per_second": 1_500.0,
        "samples_per_hour": 13_500.0,
        "predicted_train_seconds": 30.0,
        "actual_train_seconds": 36.0,
        "phase_seconds": {"pull": 2.0, "plan": 0.1, "load": 5.0, "train": 36.0, "evaluate": 4.0, "publish": 0.5},
        "losses": {
            "train": 2.5,
            "heldout_before": 2.9,
            "heldout_after": 2.6,
            "regression_before": 3.0,
            "regression_after": 3.01,
        },
        "gpu": {
            "mean_power_watts": 250.0,
            "energy_joules": 12_000.0,
            "peak_allocated_bytes": 20 * GIB,
            "peak_reserved_bytes": 24 * GIB,
            "total_memory_bytes": 96 * GIB,
            "name": "NVIDIA RTX PRO 6000",
        },
        "started_at": T0,
        "ended_at": T0 + 48.0,
        "deadline": T0 + 3600.0,
        "error": None,
        "base_model": "/models/qwen",
        "adapter_path": "/state/adapters/tiny-v0003",
    }
    s.update(over)
    return RunSummary.model_validate(s)


def gpu_event(ts: float, energy_total: float, power: float | None = 250.0, **over: Any) -> GpuEvent:
    ev = {
        "event": "gpu",
        "ts": ts,
        "power_watts": power,
        "energy_joules_total": energy_total,
        "vram_used_bytes": 30 * GIB,
        "vram_total_bytes": 96 * GIB,
        "utilization_ratio": 0.93,
        "temperature_celsius": 71.0,
    }
    ev.update(over)
    parsed = parse_event(ev)
    assert isinstance(parsed, GpuEvent)
    return parsed


def hotswap_event(kind: str, ok: bool, *, version: int = 3, ts: float = T0, **over: Any) -> HotswapEvent:
    """One target's answer, as the child reports it."""
    outcome = HotswapOutcome.model_validate({"target": f"{kind}-1", "kind": kind, "ok": ok, **over})
    return HotswapEvent(ts=ts, version=version, outcome=outcome)


def night_events(gpu: bool = True) -> list[ChildEvent]:
    """Phases, progress and (optionally) 1 Hz GPU readings, an event the series ignore, then the result."""
    evs: list[dict[str, Any]] = []
    t = T0
    for phase, secs in (("pull", 2.0), ("plan", 0.1), ("load", 5.0)):
        evs.append({"event": "phase", "ts": t, "phase": phase, "state": "start", "seconds": None})
        t += secs
        evs.append({"event": "phase", "ts": t, "phase": phase, "state": "end", "seconds": secs})
    evs.append({"event": "phase", "ts": t, "phase": "train", "state": "start", "seconds": None})
    for i in range(1, 4):
        evs.append(
            {
                "event": "progress",
                "ts": t + i,
                "version": 3,
                "fraction": i / 3,
                "tokens": 18_000 * i,
                "samples": 45 * i,
                "steps": 6 * i if i < 3 else 17,
                "tokens_per_second": 1_500.0,
                "eta": t + 3,
                "loss": 2.5,
            }
        )
        if gpu:
            evs.append(gpu_event(t + i, 1_000_000.0 + 250.0 * i).model_dump(mode="json"))
    evs.append({"event": "phase", "ts": t + 36, "phase": "train", "state": "end", "seconds": 36.0})
    evs.append({"event": "oom_split", "ts": t + 36, "tokens": 4_096, "halves": [2_048, 2_048]})  # ignored
    result = summary() if gpu else summary(gpu=None)
    evs.append({"event": "result", "ts": T0 + 48, "summary": result.model_dump(mode="json")})
    return [parse_event(json.dumps(e)) for e in evs]
