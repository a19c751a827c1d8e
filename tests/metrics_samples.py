"""A realistic night as the daemon sees it: the child's events and its RunSummary (contract shapes).

Shared by tests/test_metrics.py and tests/test_deploy_prometheus.py, so the exposition
that promtool lints and the names the dashboard/rules are checked against come from
the same feed.
"""

from __future__ import annotations

from typing import Any

T0 = 1_795_000_000.0  # a night's start (unix seconds)
GIB = 1 << 30


def summary(**over: Any) -> dict[str, Any]:
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
    return s


def gpu_event(ts: float, energy_total: float, power: float = 250.0, **over: Any) -> dict[str, Any]:
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
    return ev


def night_events(gpu: bool = True) -> list[dict[str, Any]]:
    """Phases, progress and (optionally) 1 Hz GPU readings, then the result."""
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
            evs.append(gpu_event(t + i, 1_000_000.0 + 250.0 * i))
    evs.append({"event": "phase", "ts": t + 36, "phase": "train", "state": "end", "seconds": 36.0})
    evs.append({"event": "log", "ts": t + 36, "message": "ignored"})
    evs.append({"event": "result", "ts": T0 + 48, "summary": summary(gpu=summary()["gpu"] if gpu else None)})
    return evs
