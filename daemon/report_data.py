"""The figures of the last nights, read from the ledger (read-only) and the versions' manifests:
what `nightshift report` draws and what `nightshift report --json` prints.

Summaries are read as JSON, not as the typed RunSummary: a ledger outlives code versions, and a
field a later version adds (`planned_tokens`) or an older one lacks must not hide a night.

Several adapters (issue 43): each named adapter keeps its own ledger in its own state directory
(`<state_dir>/adapters/<name>/`); `adapter_states` says which ledgers a config has, and the report
reads each one into its own `AdapterReport`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from jobs.gpu.cost import token_cost
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only

if TYPE_CHECKING:
    from daemon.settings import Settings


class GateView(BaseModel):
    passed: bool | None = None
    held_back: str | None = None
    checks: list[dict[str, Any]] = Field(default_factory=list)


class NightRow(BaseModel):
    """One run of a night, as the report shows it (None: not measured / not applicable)."""

    night: str
    run_id: str
    outcome: str
    adapter: str = ""  # whose run ([[adapters]]); "" in a config of one adapter
    attempts: int = 1  # processes that worked on this run: more than one after an interruption or a crash
    interruptions: int = 0  # stopped (SIGTERM, the window) and resumed later from a checkpoint
    failed_attempts: int = 0  # a process that died (and was retried)
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    version_name: str | None = None
    promoted: bool = False
    hotswap_failed: list[str] = Field(default_factory=list)  # inference servers that did not take the version
    # data
    ingested_samples: int = 0
    quarantined_records: int = 0
    trained_samples: int = 0
    replay_samples: int = 0
    heldout_samples: int = 0
    deferred_samples: int | None = None
    backlog_samples: int | None = None
    backlog_tokens: int | None = None
    # throughput and budget
    tokens_per_second: float | None = None
    samples_per_hour: float | None = None
    predicted_train_seconds: float | None = None
    actual_train_seconds: float | None = None
    trained_tokens: int = 0
    planned_tokens: int | None = None
    planned_tokens_from: str | None = None  # "summary" (the night recorded it) or "plan" (tokens x epochs)
    first_step_seconds: float | None = None  # wake -> the first training step (from the opening, if prewarmed)
    # quality
    losses: dict[str, float | None] = Field(default_factory=dict)
    metrics: dict[str, dict[str, float] | None] = Field(default_factory=dict)  # "<data>_<before|after>"
    gate: GateView | None = None
    kl_from_service: float | None = None  # nats per token on tonight's samples (forgetting, jobs/night/drift.py)
    # the card
    energy_joules: float | None = None
    joules_per_1k_tokens: float | None = None
    dollars_per_million_tokens: float | None = None  # with [gpu] price_per_gpu_hour (jobs/gpu/cost.py)
    mean_power_watts: float | None = None
    vram_peak_bytes: int | None = None
    vram_total_bytes: int | None = None


class CurvePoint(BaseModel):
    step: float
    loss: float


class AdapterReport(BaseModel):
    """What one ledger holds: one adapter's last nights."""

    adapter: str = ""  # "" in a config of one adapter
    state_dir: str
    nights: list[NightRow]  # oldest first
    loss_curve: list[CurvePoint] | None = None  # of the last night that published a version, if recorded
    loss_curve_version: str | None = None


class Report(AdapterReport):
    """A config of one adapter: its nights, as before. A config of several: `adapters` holds one report
    each (their names in config order) and the fields above stay empty."""

    generated_at: float
    adapters: list[AdapterReport] = Field(default_factory=list)

    def night_count(self) -> int:
        return len(self.nights) + sum(len(a.nights) for a in self.adapters)


def adapter_states(settings: Settings) -> list[tuple[str, StatePaths]]:
    """(adapter name, its state directory) for every adapter of the config, in config order: [("", the state
    dir)] in a config of one adapter. The one place the report, the metrics and the service learn the adapters
    (each named one's directory is `StatePaths.adapter(name)`, jobs/night/several)."""
    root = StatePaths(Path(settings.state_dir))
    names = [a.name for a in getattr(settings, "adapters", None) or []]
    if not names:
        return [("", root)]
    return [(name, root.adapter(name)) for name in names]


def _planned(summ: dict[str, Any]) -> tuple[int | None, str | None]:
    if summ.get("planned_tokens") is not None:
        return int(summ["planned_tokens"]), "summary"
    plan = summ.get("plan") or {}
    if plan.get("train_tokens") is not None:
        return int(plan["train_tokens"]) * int(plan.get("epochs") or 1), "plan"
    return None, None


def night_row(run: Any, summ: dict[str, Any], manifest: dict[str, Any], *, adapter: str = "",
              price_per_gpu_hour: float | None = None) -> NightRow:
    gpu = summ.get("gpu") or (manifest.get("energy") or {}).get("gpu") or {}
    energy = (manifest.get("energy") or {}).get("energy_joules") or gpu.get("energy_joules")
    tokens = int(summ.get("trained_tokens") or 0)
    start, end = summ.get("started_at") or run["started_at"], summ.get("ended_at") or run["ended_at"]
    cost = token_cost(tokens=tokens, energy_joules=energy, seconds=end - start if start and end else None,
                      cards=int(summ.get("ranks") or 1), price_per_gpu_hour=price_per_gpu_hour)
    planned, planned_from = _planned(summ)
    gate = summ.get("gate") or manifest.get("gate")
    return NightRow(
        night=run["night"], run_id=run["id"], outcome=run["status"], adapter=summ.get("adapter") or adapter,
        started_at=run["started_at"],
        ended_at=run["ended_at"], error=run["error"], version_name=summ.get("version_name"),
        promoted=bool(summ.get("promoted")),
        hotswap_failed=[str(o.get("target")) for o in summ.get("hotswap") or [] if not o.get("ok")],
        ingested_samples=sum((summ.get("ingested") or {}).values()),
        quarantined_records=sum((summ.get("quarantined") or {}).values()),
        trained_samples=int(summ.get("trained_samples") or 0), replay_samples=int(summ.get("replay_samples") or 0),
        heldout_samples=int(summ.get("heldout_samples") or 0), deferred_samples=summ.get("deferred_samples"),
        backlog_samples=summ.get("backlog_samples"), backlog_tokens=summ.get("backlog_tokens"),
        tokens_per_second=summ.get("tokens_per_second"), samples_per_hour=summ.get("samples_per_hour"),
        predicted_train_seconds=summ.get("predicted_train_seconds"),
        actual_train_seconds=summ.get("actual_train_seconds"),
        trained_tokens=tokens, planned_tokens=planned, planned_tokens_from=planned_from,
        first_step_seconds=summ.get("first_step_seconds"),
        losses=summ.get("losses") or {}, metrics=summ.get("metrics") or {},
        gate=GateView(passed=gate.get("passed"), held_back=gate.get("held_back"), checks=gate.get("checks") or [])
        if gate else None,
        kl_from_service=summ.get("kl_from_service"),
        energy_joules=energy, joules_per_1k_tokens=cost.joules_per_1k_tokens,
        dollars_per_million_tokens=cost.dollars_per_million_tokens,
        mean_power_watts=gpu.get("mean_power_watts"), vram_peak_bytes=gpu.get("peak_reserved_bytes"),
        vram_total_bytes=gpu.get("total_memory_bytes"),
    )


def loss_curve(manifest: dict[str, Any]) -> list[CurvePoint] | None:
    """The manifest's `loss_curve` ([{step, loss}, ...]) when the night recorded one."""
    curve = manifest.get("loss_curve")
    if not isinstance(curve, list):
        return None
    points = [CurvePoint.model_validate(p) for p in curve if isinstance(p, dict) and p.get("loss") is not None]
    return points or None


def collect(state_dir: Path, nights: int = 14, *, ledger: Ledger | None = None,
            price_per_gpu_hour: float | None = None) -> Report:
    """The last `nights` finished runs (oldest first) and the last published version's loss curve."""
    return Report(generated_at=time.time(), **collect_one(state_dir, nights, ledger=ledger,
                                                          price_per_gpu_hour=price_per_gpu_hour).model_dump())


def collect_adapters(states: Iterable[tuple[str, StatePaths]], root: Path, nights: int = 14, *,
                     price_per_gpu_hour: float | None = None) -> Report:
    """Every adapter's last `nights` runs, each from its own ledger (`adapter_states`): a config of one adapter
    ([("", root)]) gives the report it always did."""
    states = list(states)
    if [name for name, _ in states] == [""]:
        return collect(states[0][1].root, nights, price_per_gpu_hour=price_per_gpu_hour)
    return Report(generated_at=time.time(), state_dir=str(root), nights=[],
                  adapters=[collect_one(paths.root, nights, adapter=name, price_per_gpu_hour=price_per_gpu_hour)
                            for name, paths in states])


def collect_one(state_dir: Path, nights: int = 14, *, ledger: Ledger | None = None,
                adapter: str = "", price_per_gpu_hour: float | None = None) -> AdapterReport:
    """One ledger's last `nights` finished runs (oldest first) and its last published version's loss curve."""
    own = ledger is None
    led = ledger or open_read_only(StatePaths(state_dir).ledger)
    try:
        runs = [r for r in led.db.execute(
            "SELECT * FROM runs WHERE ended_at IS NOT NULL ORDER BY started_at DESC LIMIT ?", (nights,))][::-1]
        rows, curve, curve_version = [], None, None
        for r in runs:
            summ = json.loads(r["summary"]) if r["summary"] else {}
            version = led.version(int(r["version"])) if r["version"] is not None else None
            manifest = json.loads(version["manifest"]) if version is not None and version["manifest"] else {}
            kinds = dict(led.db.execute("SELECT kind, COUNT(*) FROM events WHERE run_id=? AND kind IN "
                                        "('interrupted', 'attempt_failed') GROUP BY kind", (r["id"],)).fetchall())
            row = night_row(r, summ, manifest, adapter=adapter, price_per_gpu_hour=price_per_gpu_hour)
            rows.append(row.model_copy(update={
                "attempts": int(r["attempt"] or 1), "interruptions": int(kinds.get("interrupted", 0)),
                "failed_attempts": int(kinds.get("attempt_failed", 0))}))
            if manifest:
                curve, curve_version = loss_curve(manifest), manifest.get("name")
        return AdapterReport(adapter=adapter, state_dir=str(state_dir), nights=rows, loss_curve=curve,
                             loss_curve_version=curve_version)
    finally:
        if own:
            led.close()
