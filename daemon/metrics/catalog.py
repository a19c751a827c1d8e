"""The one catalogue of nightshift's Prometheus series: names, kinds, help, labels, bounded label values.

Every other module (the exporter, the translation of the night into series, the tests of the
dashboard and the alert rules) names a series through the constants here, never by a literal.

Conventions: `nightshift_` prefix, base units (seconds, bytes, joules, watts, ratios 0..1),
counters end in `_total`, `*_info` gauges are 1 and carry their facts as labels; label values
are bounded by code (outcome, phase, reason, loss kind/stage) or by config (source, target kind,
adapter).

The `adapter` label (issue 43): every series of a night's run or of a version carries the adapter it is
about, so one night of several adapters (one RunSummary each) shows each adapter's figures side by side
and one adapter's summary never overwrites another's. Its value is the summary's / the event's
`adapter`: a configured adapter name, or "" in a config of one adapter, and Prometheus drops a label
whose value is empty: a single-adapter daemon exposes exactly the series it did before the label
existed (same identities, so history, `offset` comparisons and existing queries carry on). Series of
the whole night or of the daemon (the window, the card, the process) have no adapter (`NIGHT_WIDE`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from jobs.contract import Method, Outcome, Phase, QuarantineReason

Kind = Literal["gauge", "counter", "histogram"]
GAUGE: Kind = "gauge"
COUNTER: Kind = "counter"
HISTOGRAM: Kind = "histogram"

# ---- runs ----------------------------------------------------------------------------------------
RUNS_TOTAL = "nightshift_runs_total"
RUN_DURATION_SECONDS = "nightshift_run_duration_seconds"
LAST_RUN_OUTCOME = "nightshift_last_run_outcome"
LAST_SUCCESS_TIMESTAMP_SECONDS = "nightshift_last_success_timestamp_seconds"
LAST_RUN_TIMESTAMP_SECONDS = "nightshift_last_run_timestamp_seconds"
LAST_RUN_PHASE_DURATION_SECONDS = "nightshift_last_run_phase_duration_seconds"
LAST_RUN_OVERRUN_SECONDS = "nightshift_last_run_overrun_seconds"
RUN_IN_PROGRESS = "nightshift_run_in_progress"
RUN_PHASE = "nightshift_run_phase"
RUN_PROGRESS_RATIO = "nightshift_run_progress_ratio"
WINDOW_OPEN = "nightshift_window_open"
NEXT_WINDOW_START_TIMESTAMP_SECONDS = "nightshift_next_window_start_timestamp_seconds"
# ---- training (last_run_*: the most recent run, updated live while it runs) -----------------------
TRAINED_TOKENS_TOTAL = "nightshift_trained_tokens_total"
TRAINED_SAMPLES_TOTAL = "nightshift_trained_samples_total"
PREFERENCE_PAIRS_TRAINED_TOTAL = "nightshift_preference_pairs_trained_total"
LAST_RUN_STEPS = "nightshift_last_run_steps"
LAST_RUN_TOKENS_PER_SECOND = "nightshift_last_run_tokens_per_second"
LAST_RUN_SAMPLES_PER_HOUR = "nightshift_last_run_samples_per_hour"
LAST_RUN_LOSS = "nightshift_last_run_loss"
# ---- what was learned (answer-level metrics of the gate's models) ----------------------------------
LAST_RUN_EXACT_MATCH_RATIO = "nightshift_last_run_exact_match_ratio"
LAST_RUN_TOKEN_ACCURACY_RATIO = "nightshift_last_run_token_accuracy_ratio"
REGRESSION_SET_SAMPLES = "nightshift_regression_set_samples"
LAST_RUN_KL_FROM_SERVICE_NATS = "nightshift_last_run_kl_from_service_nats"
SAMPLES_RETURNED_TOTAL = "nightshift_samples_returned_total"
SAMPLES_SET_ASIDE_TOTAL = "nightshift_samples_set_aside_total"
LAST_RUN_INFO = "nightshift_last_run_info"
# ---- budget ----------------------------------------------------------------------------------------
LAST_RUN_PREDICTED_TRAIN_SECONDS = "nightshift_last_run_predicted_train_seconds"
LAST_RUN_ACTUAL_TRAIN_SECONDS = "nightshift_last_run_actual_train_seconds"
LAST_RUN_BUDGET_RATIO = "nightshift_last_run_budget_ratio"
LAST_RUN_PLANNED_TOKENS = "nightshift_last_run_planned_tokens"
LAST_RUN_TRAINED_TOKENS = "nightshift_last_run_trained_tokens"
LAST_RUN_TRAINED_TOKENS_RATIO = "nightshift_last_run_trained_tokens_ratio"
LAST_RUN_FIRST_STEP_SECONDS = "nightshift_last_run_first_step_seconds"
LAST_RUN_DEFERRED_SAMPLES = "nightshift_last_run_deferred_samples"
BACKLOG_SAMPLES = "nightshift_backlog_samples"
BACKLOG_TOKENS = "nightshift_backlog_tokens"
# ---- data ------------------------------------------------------------------------------------------
INGESTED_SAMPLES_TOTAL = "nightshift_ingested_samples_total"
QUARANTINED_SAMPLES_TOTAL = "nightshift_quarantined_samples_total"
INGESTED_FILES_TOTAL = "nightshift_ingested_files_total"
DUPLICATE_SAMPLES_TOTAL = "nightshift_duplicate_samples_total"
# ---- GPU (absent without one) ----------------------------------------------------------------------
GPU_INFO = "nightshift_gpu_info"
GPU_POWER_WATTS = "nightshift_gpu_power_watts"
GPU_ENERGY_JOULES_TOTAL = "nightshift_gpu_energy_joules_total"
GPU_MEMORY_USED_BYTES = "nightshift_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "nightshift_gpu_memory_total_bytes"
GPU_UTILIZATION_RATIO = "nightshift_gpu_utilization_ratio"
GPU_TEMPERATURE_CELSIUS = "nightshift_gpu_temperature_celsius"
LAST_RUN_GPU_MEAN_POWER_WATTS = "nightshift_last_run_gpu_mean_power_watts"
LAST_RUN_GPU_ENERGY_JOULES = "nightshift_last_run_gpu_energy_joules"
LAST_RUN_TOKENS_PER_JOULE = "nightshift_last_run_tokens_per_joule"
LAST_RUN_COST_PER_MILLION_TOKENS = "nightshift_last_run_cost_per_million_tokens"  # issue 44: unit joules / dollars
LAST_RUN_GPU_PEAK_ALLOCATED_BYTES = "nightshift_last_run_gpu_peak_allocated_bytes"
LAST_RUN_GPU_PEAK_RESERVED_BYTES = "nightshift_last_run_gpu_peak_reserved_bytes"
# each card of a night on several (label gpu: its CUDA index); the series above are their totals
GPU_CARD_POWER_WATTS = "nightshift_gpu_card_power_watts"
GPU_CARD_MEMORY_USED_BYTES = "nightshift_gpu_card_memory_used_bytes"
GPU_CARD_UTILIZATION_RATIO = "nightshift_gpu_card_utilization_ratio"
GPU_CARD_TEMPERATURE_CELSIUS = "nightshift_gpu_card_temperature_celsius"
LAST_RUN_RANKS = "nightshift_last_run_ranks"
# ---- adapters and the daemon -------------------------------------------------------------------------
ADAPTER_INFO = "nightshift_adapter_info"
ADAPTER_VERSION = "nightshift_adapter_version"
ADAPTER_VERSIONS_PUBLISHED_TOTAL = "nightshift_adapter_versions_published_total"
HOTSWAP_ATTEMPTS_TOTAL = "nightshift_hotswap_attempts_total"
HOTSWAP_CONSECUTIVE_FAILURES = "nightshift_hotswap_consecutive_failures"
BUILD_INFO = "nightshift_build_info"

ADAPTER = "adapter"  # the label naming the adapter a series is about ("" in a config of one adapter)
# the series of the night as a whole, the card and the daemon: whichever adapter trains, one value
NIGHT_WIDE = frozenset({
    RUN_IN_PROGRESS, WINDOW_OPEN, NEXT_WINDOW_START_TIMESTAMP_SECONDS,
    GPU_INFO, GPU_POWER_WATTS, GPU_ENERGY_JOULES_TOTAL, GPU_MEMORY_USED_BYTES, GPU_MEMORY_TOTAL_BYTES,
    GPU_UTILIZATION_RATIO, GPU_TEMPERATURE_CELSIUS,
    GPU_CARD_POWER_WATTS, GPU_CARD_MEMORY_USED_BYTES, GPU_CARD_UTILIZATION_RATIO, GPU_CARD_TEMPERATURE_CELSIUS,
    BUILD_INFO,
})

# ---- bounded label values --------------------------------------------------------------------------
OUTCOMES = tuple(o.value for o in Outcome)
PHASES = tuple(p.value for p in Phase)
QUARANTINE_REASONS = tuple(r.value for r in QuarantineReason)  # jobs/data: RecordError reasons
METHODS = tuple(x.value for x in Method)  # [train] method
HOTSWAP_OUTCOMES = ("success", "failure")
COST_UNITS = ("joules", "dollars")  # the `unit` of LAST_RUN_COST_PER_MILLION_TOKENS (jobs/gpu/cost.py)
# RunSummary.losses field -> (kind, stage) labels of LAST_RUN_LOSS
LOSS_LABELS = {
    "train": ("train", "after"),
    "heldout_before": ("heldout", "before"),
    "heldout_after": ("heldout", "after"),
    "regression_before": ("regression", "before"),
    "regression_after": ("regression", "after"),
}
# RunSummary.metrics stage -> the `model` label of the answer-level series
EVAL_MODELS = {"before": "service", "after": "candidate", "reference": "reference", "base": "base"}
EVAL_DATA = ("heldout", "regression", "canary", "retention", "tonight")
# minutes to hours: a skipped night takes seconds, a full window up to ~8 h
RUN_DURATION_BUCKETS = (30, 60, 300, 600, 1200, 1800, 3600, 5400, 7200, 10800, 14400, 21600, 28800, 43200)


@dataclass(frozen=True)
class Spec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only

    def series(self) -> tuple[str, ...]:
        """The names PromQL sees: a histogram is its _bucket, _sum and _count series (and the
        _created gauge prometheus_client adds); a counter's name already ends in _total."""
        if self.kind == HISTOGRAM:
            return tuple(self.name + suffix for suffix in ("_bucket", "_sum", "_count", "_created"))
        return (self.name,)


G, C, H = GAUGE, COUNTER, HISTOGRAM
_SPECS: tuple[Spec, ...] = (
    # runs
    Spec(RUNS_TOTAL, C, "Finished night runs by outcome.", ("outcome",)),
    Spec(RUN_DURATION_SECONDS, H, "Wall time of finished night runs.", buckets=RUN_DURATION_BUCKETS),
    Spec(LAST_RUN_OUTCOME, G, "1 for the outcome of the last finished run, 0 for the others.", ("outcome",)),
    Spec(LAST_SUCCESS_TIMESTAMP_SECONDS, G, "End of the last run that succeeded (unix seconds)."),
    Spec(LAST_RUN_TIMESTAMP_SECONDS, G, "End of the last finished run, any outcome (unix seconds)."),
    Spec(LAST_RUN_PHASE_DURATION_SECONDS, G, "Seconds each phase took in the last run.", ("phase",)),
    Spec(LAST_RUN_OVERRUN_SECONDS, G, "Seconds the last run ended after its window's end (0: in time)."),
    Spec(RUN_IN_PROGRESS, G, "1 while a night's child runs."),
    Spec(RUN_PHASE, G, "1 for the phase the running child is in.", ("phase",)),
    Spec(RUN_PROGRESS_RATIO, G, "Fraction of the planned training done by the running child."),
    Spec(WINDOW_OPEN, G, "1 while inside the configured training window."),
    Spec(NEXT_WINDOW_START_TIMESTAMP_SECONDS, G, "Start of the next training window (unix seconds)."),
    # training
    Spec(TRAINED_TOKENS_TOTAL, C, "Tokens trained on (real tokens, padding excluded)."),
    Spec(TRAINED_SAMPLES_TOTAL, C, "Samples trained on."),
    Spec(PREFERENCE_PAIRS_TRAINED_TOTAL, C, "Preference pairs trained on ([train] objective = \"dpo\")."),
    Spec(LAST_RUN_STEPS, G, "Optimizer steps of the last run."),
    Spec(LAST_RUN_TOKENS_PER_SECOND, G, "Training throughput of the last run."),
    Spec(LAST_RUN_SAMPLES_PER_HOUR, G, "Samples per hour of training in the last run."),
    Spec(
        LAST_RUN_LOSS,
        G,
        "Losses of the last run: kind=train|heldout|regression; stage=before (adapter in service) or after "
        "(the candidate; for train, the run's mean training loss).",
        ("kind", "stage"),
    ),
    # what was learned
    Spec(LAST_RUN_EXACT_MATCH_RATIO, G, "Share of replies the model gets exactly right (teacher-forced), last run: "
         "data=heldout|regression, model=service|candidate|reference|base; data=probe, model=server: share of the "
         "gate's probe prompts the inference server answered as the candidate in process ([hotswap.shadow]).",
         ("data", "model")),
    Spec(LAST_RUN_TOKEN_ACCURACY_RATIO, G, "Share of reply tokens (template markers excluded) the model predicts, "
         "last run: data=heldout|regression, model=service|candidate|reference|base.", ("data", "model")),
    Spec(REGRESSION_SET_SAMPLES, G, "Samples in the regression set (earlier promoted nights' held-out samples)."),
    Spec(LAST_RUN_KL_FROM_SERVICE_NATS, G, "KL divergence of the last run's candidate from the adapter in service on "
         "tonight's samples, nats per token (predicts forgetting)."),
    Spec(SAMPLES_RETURNED_TOTAL, C, "Samples of rejected nights put back (to pending, or kept out as rejected)."),
    Spec(SAMPLES_SET_ASIDE_TOTAL, C, "Samples set aside after too many rejected nights."),
    Spec(LAST_RUN_INFO, G, "How the last run trained: method=qlora|lora|full, backend=unsloth|hf.",
         ("method", "backend")),
    # budget
    Spec(LAST_RUN_PREDICTED_TRAIN_SECONDS, G, "Train seconds the plan predicted for the last run."),
    Spec(LAST_RUN_ACTUAL_TRAIN_SECONDS, G, "Train seconds the last run actually took."),
    Spec(LAST_RUN_BUDGET_RATIO, G, "Actual / predicted train seconds of the last completed training."),
    Spec(LAST_RUN_PLANNED_TOKENS, G, "Tokens the last run's plan meant to train (all epochs)."),
    Spec(LAST_RUN_TRAINED_TOKENS, G, "Tokens the last run trained (all epochs)."),
    Spec(
        LAST_RUN_TRAINED_TOKENS_RATIO,
        G,
        "Trained / planned tokens of the last completed training (below 1: the deadline cut the night short).",
    ),
    Spec(LAST_RUN_FIRST_STEP_SECONDS, G, "Seconds from the night's process start to its first training step."),
    Spec(LAST_RUN_DEFERRED_SAMPLES, G, "Pending samples the last run's plan left for a later night."),
    Spec(BACKLOG_SAMPLES, G, "Samples ingested and not trained yet."),
    Spec(BACKLOG_TOKENS, G, "Tokens of the samples ingested and not trained yet."),
    # data
    Spec(INGESTED_SAMPLES_TOTAL, C, "New samples ingested, by source.", ("source",)),
    Spec(QUARANTINED_SAMPLES_TOTAL, C, "Records quarantined, by reason.", ("reason",)),
    Spec(INGESTED_FILES_TOTAL, C, "Inbox files ingested."),
    Spec(DUPLICATE_SAMPLES_TOTAL, C, "Records skipped as already seen."),
    # GPU
    Spec(GPU_INFO, G, "The card the last run trained on.", ("name",)),
    Spec(GPU_POWER_WATTS, G, "Card power draw now (NVML, while a child runs)."),
    Spec(GPU_ENERGY_JOULES_TOTAL, C, "Energy the card used while nights ran (NVML counter deltas)."),
    Spec(GPU_MEMORY_USED_BYTES, G, "Card memory in use now, all processes (NVML)."),
    Spec(GPU_MEMORY_TOTAL_BYTES, G, "Card memory size (NVML)."),
    Spec(GPU_UTILIZATION_RATIO, G, "Card utilisation now, 0..1 (NVML)."),
    Spec(GPU_TEMPERATURE_CELSIUS, G, "Card temperature now (NVML)."),
    Spec(LAST_RUN_GPU_MEAN_POWER_WATTS, G, "Mean card power over the last run."),
    Spec(LAST_RUN_GPU_ENERGY_JOULES, G, "Card energy used by the last run."),
    Spec(LAST_RUN_TOKENS_PER_JOULE, G, "Tokens trained per joule in the last run."),
    Spec(LAST_RUN_COST_PER_MILLION_TOKENS, G, "What a million trained tokens cost in the last run: card energy "
         "(unit joules) and, with [gpu] price_per_gpu_hour, money (unit dollars) for the hours its cards were held.",
         ("unit",)),
    Spec(LAST_RUN_GPU_PEAK_ALLOCATED_BYTES, G, "torch max memory allocated in the last run."),
    Spec(LAST_RUN_GPU_PEAK_RESERVED_BYTES, G, "torch max memory reserved in the last run."),
    Spec(GPU_CARD_POWER_WATTS, G, "Power draw now of each card a night uses (NVML).", ("gpu",)),
    Spec(GPU_CARD_MEMORY_USED_BYTES, G, "Memory in use now on each card a night uses (NVML).", ("gpu",)),
    Spec(GPU_CARD_UTILIZATION_RATIO, G, "Utilisation now of each card a night uses, 0..1 (NVML).", ("gpu",)),
    Spec(GPU_CARD_TEMPERATURE_CELSIUS, G, "Temperature now of each card a night uses (NVML).", ("gpu",)),
    Spec(LAST_RUN_RANKS, G, "Processes that trained the last run: one per card (CPU processes without a GPU)."),
    # adapters and the daemon
    Spec(ADAPTER_INFO, G, "The version in service; method=full: a whole model, else a LoRA adapter.",
         ("version", "name", "base_model", "method")),
    Spec(ADAPTER_VERSION, G, "Version number of the adapter in service."),
    Spec(ADAPTER_VERSIONS_PUBLISHED_TOTAL, C, "Adapter versions published (promoted or not)."),
    Spec(
        HOTSWAP_ATTEMPTS_TOTAL,
        C,
        "Hot-swap notifications by target kind and outcome (one per target per swap, after its retries).",
        ("kind", "outcome"),
    ),
    Spec(HOTSWAP_CONSECUTIVE_FAILURES, G, "Failed hot-swaps since the last success, by target kind.", ("kind",)),
    Spec(BUILD_INFO, G, "Build of the running daemon.", ("version", "python_version")),
)
# every series but the night's own carries `adapter` first
SPECS: tuple[Spec, ...] = tuple(s if s.name in NIGHT_WIDE else replace(s, labels=(ADAPTER, *s.labels))
                                for s in _SPECS)
BY_NAME: dict[str, Spec] = {s.name: s for s in SPECS}
SERIES: frozenset[str] = frozenset(n for s in SPECS for n in s.series())  # every name PromQL may see
