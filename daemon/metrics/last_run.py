"""A RunSummary as the last-run gauges of its adapter: at a run's end (night.py's `on_summary`) and from
the ledger when the daemon starts (`restore_last_run`), so both paths set exactly the same series."""

from __future__ import annotations

from typing import Any

import daemon.metrics.catalog as m  # every series is named as m.<CONSTANT>
from daemon.metrics.exporter import _Scoped
from jobs.contract import GpuSummary, Outcome, RunSummary
from jobs.gpu.cost import summary_cost

COMPLETED = (Outcome.succeeded, Outcome.rejected)  # an interrupted run's time says nothing of the plan
# GpuSummary field -> series
SUMMARY_GPU_GAUGES = {
    "mean_power_watts": m.LAST_RUN_GPU_MEAN_POWER_WATTS,
    "energy_joules": m.LAST_RUN_GPU_ENERGY_JOULES,
    "peak_allocated_bytes": m.LAST_RUN_GPU_PEAK_ALLOCATED_BYTES,
    "peak_reserved_bytes": m.LAST_RUN_GPU_PEAK_RESERVED_BYTES,
}


def as_float(x: Any) -> float | None:
    return None if x is None else float(x)


def last_run(v: _Scoped, s: RunSummary, ended: float, window_end: float | None,
             price_per_gpu_hour: float | None = None) -> None:
    """Every last-run gauge of the summary's adapter: at a run's end, and from the ledger at a restart."""
    outcome = s.outcome.value
    for o in {*m.OUTCOMES, outcome}:
        v.set(m.LAST_RUN_OUTCOME, 1 if o == outcome else 0, outcome=o)
    v.set(m.LAST_RUN_TIMESTAMP_SECONDS, ended)
    if s.outcome == Outcome.succeeded:
        v.set(m.LAST_SUCCESS_TIMESTAMP_SECONDS, ended)
    v.clear(m.LAST_RUN_PHASE_DURATION_SECONDS)
    for phase, secs in s.phase_seconds.items():
        v.set(m.LAST_RUN_PHASE_DURATION_SECONDS, secs, phase=phase)
    v.set(m.LAST_RUN_OVERRUN_SECONDS, None if window_end is None else max(0.0, ended - window_end))
    v.set(m.LAST_RUN_STEPS, s.steps)
    v.set(m.LAST_RUN_RANKS, s.ranks if s.steps else None)  # known where the run trained
    v.set(m.LAST_RUN_TOKENS_PER_SECOND, s.tokens_per_second)
    v.set(m.LAST_RUN_SAMPLES_PER_HOUR, s.samples_per_hour)
    v.clear(m.LAST_RUN_LOSS)
    for field, (kind, stage) in m.LOSS_LABELS.items():
        v.set(m.LAST_RUN_LOSS, getattr(s.losses, field), kind=kind, stage=stage)
    if s.method is not None:  # a run that trained (or published): how
        v.clear(m.LAST_RUN_INFO)
        v.set(m.LAST_RUN_INFO, 1, method=s.method.value, backend=(s.plan.backend if s.plan else None) or "")
    answers(v, s)
    # the budget: seconds and tokens; a night cut short by its deadline shows in the tokens
    predicted, actual, planned = s.predicted_train_seconds, s.actual_train_seconds, s.planned_tokens
    completed = s.outcome in COMPLETED
    v.set(m.LAST_RUN_PREDICTED_TRAIN_SECONDS, predicted)
    v.set(m.LAST_RUN_ACTUAL_TRAIN_SECONDS, actual)
    v.set(m.LAST_RUN_BUDGET_RATIO, actual / predicted if completed and predicted and actual else None)
    v.set(m.LAST_RUN_PLANNED_TOKENS, planned)
    v.set(m.LAST_RUN_TRAINED_TOKENS, s.trained_tokens if planned is not None else None)
    v.set(m.LAST_RUN_TRAINED_TOKENS_RATIO, s.trained_tokens / planned if completed and planned else None)
    v.set(m.LAST_RUN_FIRST_STEP_SECONDS, s.first_step_seconds)
    v.set(m.LAST_RUN_DEFERRED_SAMPLES, s.deferred_samples)
    if s.backlog_samples is not None:
        v.set(m.BACKLOG_SAMPLES, s.backlog_samples)
        v.set(m.BACKLOG_TOKENS, as_float(s.backlog_tokens))
    summary_gpu(v, s.gpu, s.trained_tokens)
    cost = summary_cost(s, price_per_gpu_hour)
    v.set(m.LAST_RUN_COST_PER_MILLION_TOKENS, cost.joules_per_million_tokens, unit="joules")
    v.set(m.LAST_RUN_COST_PER_MILLION_TOKENS, cost.dollars_per_million_tokens, unit="dollars")


def answers(v: _Scoped, s: RunSummary) -> None:
    """Exact match and reply token accuracy of every model the gate compared; the regression set's size."""
    v.clear(m.LAST_RUN_EXACT_MATCH_RATIO)
    v.clear(m.LAST_RUN_TOKEN_ACCURACY_RATIO)
    for stage, model in m.EVAL_MODELS.items():
        for data in m.EVAL_DATA:
            figures = s.metrics.get(f"{data}_{stage}") or {}
            v.set(m.LAST_RUN_EXACT_MATCH_RATIO, as_float(figures.get("exact_match")), data=data, model=model)
            v.set(m.LAST_RUN_TOKEN_ACCURACY_RATIO, as_float(figures.get("token_accuracy")), data=data, model=model)
    # [hotswap.shadow]: the share of probes the server answered as the candidate did in process
    v.set(m.LAST_RUN_EXACT_MATCH_RATIO, as_float((s.metrics.get("probe_server") or {}).get("exact_match")),
          data="probe", model="server")
    if s.regression_samples is not None:
        v.set(m.REGRESSION_SET_SAMPLES, s.regression_samples)
    v.set(m.LAST_RUN_KL_FROM_SERVICE_NATS, as_float(s.kl_from_service))


def summary_gpu(v: _Scoped, gpu: GpuSummary | None, tokens: int) -> None:
    for key, name in SUMMARY_GPU_GAUGES.items():
        v.set(name, as_float(getattr(gpu, key)) if gpu else None)
    joules = gpu.energy_joules if gpu else None
    v.set(m.LAST_RUN_TOKENS_PER_JOULE, tokens / joules if joules and tokens else None)
    if gpu and gpu.total_memory_bytes is not None:
        v.set(m.GPU_MEMORY_TOTAL_BYTES, gpu.total_memory_bytes)
    if gpu and gpu.name:
        v.clear(m.GPU_INFO)
        v.set(m.GPU_INFO, 1, name=gpu.name)
