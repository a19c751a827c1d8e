"""daemon/metrics against a fresh CollectorRegistry: typed events and summaries land in the right series."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from daemon.metrics import OUTCOMES, QUARANTINE_REASONS, MetricsConfig, NightshiftMetrics, catalog, serve
from jobs.contract import Outcome, Phase, PhaseEvent, ProgressEvent, ResultEvent, RunSummary, parse_event
from tests.fixtures.metrics_samples import GIB, T0, gpu_event, hotswap_event, night_events, summary

DAEMON = Path(__file__).resolve().parents[2] / "daemon"


@pytest.fixture()
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def names(reg: CollectorRegistry) -> set[str]:
    return {s.name for fam in reg.collect() for s in fam.samples}


def val(reg: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return reg.get_sample_value(metric, labels)


def test_fresh_registry_exposes_zero_counters_and_nothing_unknown(reg: CollectorRegistry) -> None:
    NightshiftMetrics(reg, sources=["inbox"], hotswap_kinds=["vllm"], version="1.2.3")
    for outcome in OUTCOMES:
        assert val(reg, "nightshift_runs_total", outcome=outcome) == 0
    for reason in QUARANTINE_REASONS:
        assert val(reg, "nightshift_quarantined_samples_total", reason=reason) == 0
    assert val(reg, "nightshift_ingested_samples_total", source="inbox") == 0
    assert val(reg, "nightshift_hotswap_attempts_total", kind="vllm", outcome="failure") == 0
    assert val(reg, "nightshift_run_in_progress") == 0
    assert (
        val(
            reg,
            "nightshift_build_info",
            version="1.2.3",
            python_version=pytest.importorskip("platform").python_version(),
        )
        == 1
    )
    present = names(reg)
    for unknown in (
        "nightshift_last_success_timestamp_seconds",
        "nightshift_last_run_timestamp_seconds",
        "nightshift_window_open",
        "nightshift_last_run_budget_ratio",
        "nightshift_adapter_info",
        "nightshift_backlog_samples",
    ):
        assert unknown not in present
    assert not [n for n in present if "gpu" in n]


def test_a_night_with_a_gpu(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    evs = night_events(gpu=True)
    rest = evs[-3:]  # train end, an OOM split (no series of its own), the result
    for ev in evs[:-3]:
        m.on_event(ev)
    # live, before the result
    assert val(reg, "nightshift_run_in_progress") == 1
    assert val(reg, "nightshift_run_phase", phase="train") == 1
    assert val(reg, "nightshift_run_progress_ratio") == pytest.approx(1.0)
    assert val(reg, "nightshift_gpu_power_watts") == 250.0
    assert val(reg, "nightshift_gpu_memory_used_bytes") == 30 * GIB
    assert val(reg, "nightshift_gpu_utilization_ratio") == 0.93
    assert val(reg, "nightshift_gpu_temperature_celsius") == 71.0
    assert val(reg, "nightshift_gpu_energy_joules_total") == 500.0  # 3 readings 250 J apart: 2 deltas
    # two cards: the series above are their totals, each card's own reading carries its `gpu` label
    assert val(reg, "nightshift_gpu_card_power_watts", gpu="0") == val(reg, "nightshift_gpu_card_power_watts",
                                                                       gpu="1") == 125.0
    assert val(reg, "nightshift_gpu_card_memory_used_bytes", gpu="1") == 15 * GIB
    assert val(reg, "nightshift_gpu_card_temperature_celsius", gpu="1") == 69.0
    assert val(reg, "nightshift_trained_tokens_total") == 54_000
    assert val(reg, "nightshift_last_run_tokens_per_second") == 1_500.0
    for ev in rest:
        m.on_event(ev)

    assert val(reg, "nightshift_runs_total", outcome="succeeded") == 1
    assert val(reg, "nightshift_last_run_outcome", outcome="succeeded") == 1
    assert val(reg, "nightshift_last_run_outcome", outcome="failed") == 0
    assert val(reg, "nightshift_last_success_timestamp_seconds") == T0 + 48
    assert val(reg, "nightshift_last_run_timestamp_seconds") == T0 + 48
    assert val(reg, "nightshift_last_run_phase_duration_seconds", phase="train") == 36.0
    assert val(reg, "nightshift_last_run_phase_duration_seconds", phase="hotswap") is None
    assert val(reg, "nightshift_run_duration_seconds_count") == 1
    assert val(reg, "nightshift_run_duration_seconds_sum") == 48.0
    assert val(reg, "nightshift_run_duration_seconds_bucket", le="60.0") == 1
    assert val(reg, "nightshift_run_duration_seconds_bucket", le="30.0") == 0
    assert val(reg, "nightshift_last_run_overrun_seconds") == 0.0  # before its deadline, no window known
    # training: progress and summary agree, nothing counted twice
    assert val(reg, "nightshift_trained_tokens_total") == 54_000
    assert val(reg, "nightshift_trained_samples_total") == 135
    assert val(reg, "nightshift_last_run_steps") == 17
    assert val(reg, "nightshift_last_run_samples_per_hour") == 13_500.0
    assert val(reg, "nightshift_last_run_loss", kind="train", stage="after") == 2.5
    assert val(reg, "nightshift_last_run_loss", kind="heldout", stage="before") == 2.9
    assert val(reg, "nightshift_last_run_loss", kind="regression", stage="after") == 3.01
    # budget
    assert val(reg, "nightshift_last_run_predicted_train_seconds") == 30.0
    assert val(reg, "nightshift_last_run_actual_train_seconds") == 36.0
    assert val(reg, "nightshift_last_run_budget_ratio") == pytest.approx(1.2)
    assert val(reg, "nightshift_last_run_deferred_samples") == 10
    assert val(reg, "nightshift_backlog_samples") == 10
    assert val(reg, "nightshift_backlog_tokens") == 4_000
    # data
    assert val(reg, "nightshift_ingested_samples_total", source="inbox") == 120
    assert val(reg, "nightshift_ingested_samples_total", source="support") == 30
    assert val(reg, "nightshift_quarantined_samples_total", reason="invalid_json") == 2
    assert val(reg, "nightshift_quarantined_samples_total", reason="too_long") == 1
    assert val(reg, "nightshift_quarantined_samples_total", reason="bad_file") == 0
    assert val(reg, "nightshift_ingested_files_total") == 4
    assert val(reg, "nightshift_duplicate_samples_total") == 5
    # GPU: last-run figures stay, live readings go with the child; the counter and the card's size stay
    assert val(reg, "nightshift_last_run_gpu_mean_power_watts") == 250.0
    assert val(reg, "nightshift_last_run_gpu_energy_joules") == 12_000.0
    assert val(reg, "nightshift_last_run_tokens_per_joule") == pytest.approx(4.5)
    assert val(reg, "nightshift_last_run_gpu_peak_allocated_bytes") == 20 * GIB
    assert val(reg, "nightshift_last_run_gpu_peak_reserved_bytes") == 24 * GIB
    assert val(reg, "nightshift_gpu_memory_total_bytes") == 96 * GIB
    assert val(reg, "nightshift_gpu_info", name="NVIDIA RTX PRO 6000") == 1
    assert val(reg, "nightshift_gpu_energy_joules_total") == 500.0
    for live in (
        "nightshift_gpu_power_watts",
        "nightshift_gpu_memory_used_bytes",
        "nightshift_gpu_utilization_ratio",
        "nightshift_gpu_temperature_celsius",
        "nightshift_gpu_card_power_watts",
        "nightshift_gpu_card_memory_used_bytes",
        "nightshift_run_progress_ratio",
        "nightshift_run_phase",
    ):
        assert live not in names(reg), live
    assert val(reg, "nightshift_last_run_ranks") == 2
    assert val(reg, "nightshift_run_in_progress") == 0
    # adapters
    assert val(reg, "nightshift_adapter_info", version="3", name="tiny-v0003", base_model="/models/qwen",
               method="qlora") == 1
    assert val(reg, "nightshift_adapter_version") == 3
    assert val(reg, "nightshift_adapter_versions_published_total") == 1


def test_what_is_not_a_child_event_never_reaches_the_series() -> None:
    """The supervisor validates each line with parse_event: a line the contract does not know is refused
    there (and logged), so NightshiftMetrics only ever sees typed events."""
    with pytest.raises(ValueError, match="not a child event"):
        parse_event('{"event": "log", "ts": 1, "message": "hello"}')
    with pytest.raises(ValueError, match="not a child event"):
        parse_event({"event": "progress", "fraction": "off"})


def test_gpu_series_are_absent_without_a_gpu(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    for ev in night_events(gpu=False):
        m.on_event(ev)
    assert val(reg, "nightshift_runs_total", outcome="succeeded") == 1
    gpu = [n for n in names(reg) if "gpu" in n or "joule" in n]
    assert gpu == []


def test_gpu_readings_the_card_does_not_give_are_absent(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    m.on_event(gpu_event(T0, 100.0, power=None, temperature_celsius=None))
    present = names(reg)
    assert "nightshift_gpu_power_watts" not in present
    assert "nightshift_gpu_temperature_celsius" not in present
    assert val(reg, "nightshift_gpu_memory_used_bytes") == 30 * GIB
    assert val(reg, "nightshift_gpu_energy_joules_total") == 0.0  # a GPU is there: the counter starts at 0


def test_energy_counter_adds_positive_deltas_and_survives_resets(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg, energy_gap_seconds=60)
    energy = lambda: val(reg, "nightshift_gpu_energy_joules_total")  # noqa: E731
    m.on_event(gpu_event(T0, 5_000_000.0))  # first reading: the card's whole history is not ours
    assert energy() == 0.0
    m.on_event(gpu_event(T0 + 1, 5_000_300.0))
    m.on_event(gpu_event(T0 + 2, 5_000_600.0))
    assert energy() == 600.0
    m.on_event(gpu_event(T0 + 3, 5_000_600.0, energy_joules_total=None))  # unknown: ignored
    m.on_event(gpu_event(T0 + 4, 200.0))  # driver reload reset the card's counter: re-baseline
    assert energy() == 600.0
    m.on_event(gpu_event(T0 + 5, 450.0))
    assert energy() == 850.0
    m.on_child_exit()  # a new child: its first reading is a baseline, not a delta from the old one
    m.on_event(gpu_event(T0 + 100, 90_000.0))
    assert energy() == 850.0
    m.on_event(gpu_event(T0 + 101, 90_100.0))
    assert energy() == 950.0
    m.on_event(gpu_event(T0 + 500, 190_100.0))  # a gap longer than energy_gap_seconds: the child was away
    assert energy() == 950.0
    m.on_event(gpu_event(T0 + 501, 190_150.0))
    assert energy() == 1_000.0


def test_a_resumed_run_counts_each_trained_token_once(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)

    def prog(tokens: int, samples: int) -> ProgressEvent:
        return ProgressEvent(
            ts=T0, version=3, fraction=0.5, tokens=tokens, samples=samples, steps=1, tokens_per_second=1.0, eta=None
        )

    m.on_event(prog(1_000, 10))
    m.on_event(prog(2_000, 20))
    m.on_event(
        ResultEvent(
            ts=T0,
            summary=summary(outcome="interrupted", trained_tokens=2_000, trained_samples=20, ended_at=T0 + 10),
        )
    )
    m.on_event(prog(3_000, 30))  # the retry resumes from the checkpoint's figures
    m.on_event(ResultEvent(ts=T0, summary=summary(trained_tokens=4_000, trained_samples=40)))
    assert val(reg, "nightshift_trained_tokens_total") == 4_000
    assert val(reg, "nightshift_trained_samples_total") == 40
    assert val(reg, "nightshift_runs_total", outcome="interrupted") == 1
    assert val(reg, "nightshift_runs_total", outcome="succeeded") == 1
    assert val(reg, "nightshift_adapter_versions_published_total") == 1


def test_the_same_summary_twice_counts_once(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    s = summary()
    m.on_event(ResultEvent(ts=T0, summary=s))
    m.on_summary(s)  # the supervisor also hands ChildOutcome.summary over
    assert val(reg, "nightshift_runs_total", outcome="succeeded") == 1
    assert val(reg, "nightshift_ingested_files_total") == 4
    assert val(reg, "nightshift_run_duration_seconds_count") == 1


def test_a_crash_reported_as_a_minimal_summary(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg, clock=lambda: T0 + 99)
    m.on_event(PhaseEvent(ts=T0, phase=Phase.load, state="start"))
    m.on_summary(RunSummary(outcome=Outcome.failed))
    assert val(reg, "nightshift_runs_total", outcome="failed") == 1
    assert val(reg, "nightshift_last_run_outcome", outcome="failed") == 1
    assert val(reg, "nightshift_last_run_timestamp_seconds") == T0 + 99
    assert val(reg, "nightshift_run_in_progress") == 0
    assert "nightshift_last_success_timestamp_seconds" not in names(reg)


def test_skipped_and_interrupted_runs_clear_what_they_do_not_know(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    m.on_summary(summary())
    m.on_summary(summary(run_id="b", outcome="interrupted", actual_train_seconds=5.0))
    assert "nightshift_last_run_budget_ratio" not in names(reg)  # a cut-short run says nothing of the plan
    assert val(reg, "nightshift_last_run_actual_train_seconds") == 5.0
    skipped = summary(
        run_id="c",
        outcome="skipped",
        version=None,
        version_name=None,
        promoted=False,
        trained_samples=0,
        trained_tokens=0,
        steps=0,
        tokens_per_second=None,
        samples_per_hour=None,
        predicted_train_seconds=0.0,
        actual_train_seconds=None,
        phase_seconds={"pull": 1.0},
        losses=dict.fromkeys(("train", "heldout_before", "heldout_after", "regression_before", "regression_after")),
        gpu=None,
        adapter_path=None,
        started_at=T0 + 86_400,
        ended_at=T0 + 86_401,
    )
    m.on_summary(skipped)
    present = names(reg)
    for gone in (
        "nightshift_last_run_loss",
        "nightshift_last_run_tokens_per_second",
        "nightshift_last_run_budget_ratio",
        "nightshift_last_run_gpu_energy_joules",
        "nightshift_last_run_tokens_per_joule",
    ):
        assert gone not in present, gone
    assert val(reg, "nightshift_last_run_phase_duration_seconds", phase="pull") == 1.0
    assert val(reg, "nightshift_last_run_phase_duration_seconds", phase="train") is None
    assert val(reg, "nightshift_last_success_timestamp_seconds") == T0 + 48  # unchanged
    assert val(reg, "nightshift_last_run_outcome", outcome="skipped") == 1
    assert val(reg, "nightshift_adapter_version") == 3  # still in service
    assert val(reg, "nightshift_gpu_memory_total_bytes") == 96 * GIB  # the card did not shrink


def test_overrun_is_measured_against_the_window_end(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    m.set_window(True, T0 + 86_400, end=T0 + 40)
    assert val(reg, "nightshift_window_open") == 1
    assert val(reg, "nightshift_next_window_start_timestamp_seconds") == T0 + 86_400
    m.on_event(PhaseEvent(ts=T0, phase=Phase.pull, state="start"))
    m.set_window(False, T0 + 86_400)
    assert val(reg, "nightshift_window_open") == 0
    m.on_summary(summary())  # ended at T0 + 48
    assert val(reg, "nightshift_last_run_overrun_seconds") == 8.0
    m.on_summary(summary(run_id="late", ended_at=T0 + 3_700, deadline=T0 + 3_600))
    assert val(reg, "nightshift_last_run_overrun_seconds") == 3_660.0  # the last known window end still holds


def test_hotswap_and_adapter_and_backlog(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg, hotswap_kinds=["vllm", "webhook"])
    m.on_hotswap("vllm", False)
    m.on_event(hotswap_event("vllm", False, target="gpu-box", attempts=3, seconds=1.0, error="503"))
    assert val(reg, "nightshift_hotswap_attempts_total", kind="vllm", outcome="failure") == 2
    assert val(reg, "nightshift_hotswap_consecutive_failures", kind="vllm") == 2
    m.on_hotswap("vllm", True)
    assert val(reg, "nightshift_hotswap_consecutive_failures", kind="vllm") == 0
    assert val(reg, "nightshift_hotswap_attempts_total", kind="vllm", outcome="success") == 1
    assert val(reg, "nightshift_hotswap_attempts_total", kind="webhook", outcome="success") == 0
    m.set_adapter_in_service(4, "tiny-v0004", "/models/qwen")
    m.set_adapter_in_service(5, "tiny-v0005", "/models/qwen", "full")  # one info series at a time
    assert [s.labels for f in reg.collect() for s in f.samples if s.name == "nightshift_adapter_info"] == [
        {"version": "5", "name": "tiny-v0005", "base_model": "/models/qwen", "method": "full"}
    ]
    m.set_backlog(7, 700)
    assert val(reg, "nightshift_backlog_samples") == 7
    m.set_backlog(None, None)
    assert "nightshift_backlog_samples" not in names(reg)


def test_restore_seeds_the_last_runs_after_a_restart(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    m.restore(last_success=T0, last_run=T0 + 10, last_outcome="failed")
    assert val(reg, "nightshift_last_success_timestamp_seconds") == T0
    assert val(reg, "nightshift_last_run_timestamp_seconds") == T0 + 10
    assert val(reg, "nightshift_last_run_outcome", outcome="failed") == 1
    assert val(reg, "nightshift_last_run_outcome", outcome="succeeded") == 0


def test_wrong_labels_are_a_programming_error(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    with pytest.raises(ValueError, match="takes labels"):
        m.values.set("nightshift_runs_total", 1)
    with pytest.raises(ValueError, match="only go up"):
        m.values.inc("nightshift_ingested_files_total", -1)


def test_config_defaults_and_unknown_keys() -> None:
    cfg = MetricsConfig()
    assert (cfg.address, cfg.port, cfg.enabled) == ("127.0.0.1", 9464, True)
    with pytest.raises(ValidationError):
        MetricsConfig.model_validate({"adress": "0.0.0.0"})
    with pytest.raises(ValidationError):
        MetricsConfig(port=70_000)


def test_serve_on_loopback_and_shut_down(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    m.on_summary(summary())
    assert serve(MetricsConfig(enabled=False), reg) is None
    srv = serve(MetricsConfig(port=0), reg)
    assert srv is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'nightshift_runs_total{outcome="succeeded"} 1.0' in text
        assert "nightshift_last_run_gpu_energy_joules 12000.0" in text
    finally:
        srv.close()
    assert not srv.thread.is_alive()


# ---- the catalogue -------------------------------------------------------------------------------
def test_the_catalogue_names_each_series_once_by_the_conventions() -> None:
    constants = {
        k: v for k, v in vars(catalog).items() if k.isupper() and isinstance(v, str) and v.startswith("nightshift_")
    }
    names = [spec.name for spec in catalog.SPECS]
    assert len(names) == len(set(names))
    assert sorted(constants.values()) == sorted(names)  # one constant per series, each in SPECS
    for const, name in constants.items():
        assert const == name.removeprefix("nightshift_").upper(), const
    for spec in catalog.SPECS:
        assert re.fullmatch(r"nightshift_[a-z0-9_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == catalog.COUNTER), spec.name
        assert bool(spec.buckets) == (spec.kind == catalog.HISTOGRAM), spec.name
    assert tuple(o.value for o in Outcome) == catalog.OUTCOMES
    assert tuple(p.value for p in Phase) == catalog.PHASES


def test_every_registered_series_is_catalogued(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg, sources=["inbox"], hotswap_kinds=["vllm"])
    for ev in night_events(gpu=True):
        m.on_event(ev)
    exposed = {s.name for fam in reg.collect() for s in fam.samples}
    assert exposed <= catalog.SERIES, sorted(exposed - catalog.SERIES)
    assert {f.name for f in reg.collect()} <= {s.name.removesuffix("_total") for s in catalog.SPECS}


def test_no_metric_name_is_written_outside_the_catalogue() -> None:
    """The exporter and the translation name series through catalog's constants only."""
    literal = re.compile(r"""["']nightshift_[a-z0-9_]+["']""")
    found = [
        f"{path.relative_to(DAEMON.parent)}:{n}: {line.strip()}"
        for path in sorted(DAEMON.rglob("*.py"))
        if path != DAEMON / "metrics" / "catalog.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, found


def test_what_was_learned_and_rejected_nights_samples_become_series(reg: CollectorRegistry) -> None:
    m = NightshiftMetrics(reg)
    assert val(reg, catalog.SAMPLES_RETURNED_TOTAL) == 0 and val(reg, catalog.SAMPLES_SET_ASIDE_TOTAL) == 0
    m.on_summary(summary())
    em, acc = catalog.LAST_RUN_EXACT_MATCH_RATIO, catalog.LAST_RUN_TOKEN_ACCURACY_RATIO
    assert val(reg, em, data="regression", model="service") == 0.9
    assert val(reg, em, data="regression", model="candidate") == 0.925
    assert val(reg, em, data="regression", model="reference") == 0.9
    assert val(reg, em, data="regression", model="base") == 0.0
    assert val(reg, acc, data="heldout", model="candidate") == 0.8
    assert val(reg, em, data="heldout", model="reference") is None  # not measured: absent, not 0
    assert val(reg, catalog.REGRESSION_SET_SAMPLES) == 40
    assert val(reg, catalog.SAMPLES_RETURNED_TOTAL) == 12 and val(reg, catalog.SAMPLES_SET_ASIDE_TOTAL) == 3
    m.on_summary(summary(run_id="next", outcome="skipped", metrics={}, returned_samples=0, set_aside_samples=0,
                         regression_samples=None))
    assert val(reg, em, data="regression", model="candidate") is None  # the last run measured nothing
    assert val(reg, catalog.SAMPLES_RETURNED_TOTAL) == 12 and val(reg, catalog.REGRESSION_SET_SAMPLES) == 40
