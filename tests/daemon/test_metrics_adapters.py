"""Several adapters in one night (issue 43): each summary and event lands in its adapter's series (label
`adapter`), one adapter never resets another's, the night's own series carry no adapter, and a config of
one adapter exposes exactly what it did before the label existed."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from daemon.metrics import NightshiftMetrics, catalog
from daemon.service import Service
from daemon.settings import load_settings
from jobs.contract import Phase, PhaseEvent, ProgressEvent, ResultEvent
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from tests.conftest import toml_config
from tests.fixtures.metrics_samples import T0, gpu_event, hotswap_event, night_events, summary


def val(reg: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return reg.get_sample_value(metric, labels)


def label_sets(reg: CollectorRegistry, metric: str) -> list[dict[str, str]]:
    return [s.labels for f in reg.collect() for s in f.samples if s.name == metric]


def two(reg: CollectorRegistry) -> NightshiftMetrics:
    return NightshiftMetrics(reg, adapters=["support", "legal"], hotswap_kinds=["vllm"],
                             sources={"support": ["tickets"], "legal": ["contracts"]})


def test_two_adapters_summaries_keep_their_own_series(tmp_path) -> None:
    reg = CollectorRegistry()
    m = two(reg)
    # both adapters publish their own version 3 (each numbers its versions from 1)
    m.on_summary(summary(adapter="support", version_name="support-v0003", trained_tokens=54_000,
                         ingested={"tickets": 120}, backlog_samples=10, kl_from_service=0.012))
    m.on_summary(summary(adapter="legal", run_id="2026-11-21-legal", outcome="rejected", promoted=False,
                         version_name="legal-v0003", trained_tokens=8_000, planned_tokens=8_000,
                         ingested={"contracts": 30}, backlog_samples=99, kl_from_service=0.5,
                         losses={"train": 1.0, "heldout_before": 1.1, "heldout_after": 1.4}))
    s, g = {"adapter": "support"}, {"adapter": "legal"}
    # the last-run gauges: each adapter's own, the second summary did not overwrite the first
    assert val(reg, catalog.LAST_RUN_OUTCOME, **s, outcome="succeeded") == 1
    assert val(reg, catalog.LAST_RUN_OUTCOME, **g, outcome="rejected") == 1
    assert val(reg, catalog.LAST_RUN_OUTCOME, **g, outcome="succeeded") == 0
    assert val(reg, catalog.LAST_RUN_KL_FROM_SERVICE_NATS, **s) == 0.012
    assert val(reg, catalog.LAST_RUN_KL_FROM_SERVICE_NATS, **g) == 0.5
    assert val(reg, catalog.LAST_RUN_LOSS, **s, kind="heldout", stage="after") == 2.6
    assert val(reg, catalog.LAST_RUN_LOSS, **g, kind="heldout", stage="after") == 1.4
    assert val(reg, catalog.LAST_RUN_LOSS, **g, kind="regression", stage="after") is None
    assert val(reg, catalog.LAST_RUN_EXACT_MATCH_RATIO, **s, data="heldout", model="candidate") == 0.75
    assert val(reg, catalog.BACKLOG_SAMPLES, **s) == 10 and val(reg, catalog.BACKLOG_SAMPLES, **g) == 99
    assert val(reg, catalog.LAST_SUCCESS_TIMESTAMP_SECONDS, **s) == T0 + 48
    assert val(reg, catalog.LAST_SUCCESS_TIMESTAMP_SECONDS, **g) is None  # legal never succeeded: absent
    # counters: per adapter, version 3 of one is not version 3 of the other
    assert val(reg, catalog.TRAINED_TOKENS_TOTAL, **s) == 54_000
    assert val(reg, catalog.TRAINED_TOKENS_TOTAL, **g) == 8_000
    assert val(reg, catalog.ADAPTER_VERSIONS_PUBLISHED_TOTAL, **s) == 1
    assert val(reg, catalog.ADAPTER_VERSIONS_PUBLISHED_TOTAL, **g) == 1
    assert val(reg, catalog.RUNS_TOTAL, **s, outcome="succeeded") == 1
    assert val(reg, catalog.RUNS_TOTAL, **g, outcome="rejected") == 1
    assert val(reg, catalog.RUNS_TOTAL, **g, outcome="succeeded") == 0
    assert val(reg, catalog.INGESTED_SAMPLES_TOTAL, **s, source="tickets") == 120
    assert val(reg, catalog.INGESTED_SAMPLES_TOTAL, **g, source="contracts") == 30
    assert val(reg, catalog.INGESTED_SAMPLES_TOTAL, **g, source="tickets") is None  # a source feeds one adapter
    assert val(reg, f"{catalog.RUN_DURATION_SECONDS}_count", **s) == 1
    assert val(reg, f"{catalog.RUN_DURATION_SECONDS}_count", **g) == 1
    # the version in service: support's only (legal's was rejected), one info series per adapter
    assert label_sets(reg, catalog.ADAPTER_INFO) == [
        {"adapter": "support", "version": "3", "name": "support-v0003", "base_model": "/models/qwen",
         "method": "qlora"}]
    m.set_adapter_in_service(2, "legal-v0002", "/models/qwen", adapter="legal")
    m.set_adapter_in_service(4, "support-v0004", "/models/qwen", adapter="support")
    assert sorted(d["name"] for d in label_sets(reg, catalog.ADAPTER_INFO)) == ["legal-v0002", "support-v0004"]
    assert val(reg, catalog.ADAPTER_VERSION, **g) == 2 and val(reg, catalog.ADAPTER_VERSION, **s) == 4
    # the card's figures are the night's: no adapter label
    assert label_sets(reg, catalog.GPU_INFO) == [{"name": "NVIDIA RTX PRO 6000"}]
    assert label_sets(reg, catalog.GPU_MEMORY_TOTAL_BYTES) == [{}]


def test_every_series_but_the_nights_own_carries_the_adapter() -> None:
    reg = CollectorRegistry()
    m = two(reg)
    m.set_window(True, T0 + 86_400, end=T0 + 3_600)
    for ev in night_events(gpu=True)[:-1]:
        m.on_event(ev.model_copy(update={"adapter": "support"}))
    m.on_event(ResultEvent(ts=T0 + 48, adapter="support", summary=summary(adapter="support")))
    m.on_event(hotswap_event("vllm", False).model_copy(update={"adapter": "legal"}))
    for fam in reg.collect():
        for sample in fam.samples:
            spec = catalog.BY_NAME.get(fam.name) or catalog.BY_NAME[fam.name + "_total"]
            if spec.name in catalog.NIGHT_WIDE:
                assert "adapter" not in sample.labels, sample
            else:
                assert sample.labels.get("adapter") in ("support", "legal"), sample
    assert val(reg, catalog.HOTSWAP_CONSECUTIVE_FAILURES, adapter="legal", kind="vllm") == 1
    assert val(reg, catalog.HOTSWAP_CONSECUTIVE_FAILURES, adapter="support", kind="vllm") == 0
    assert val(reg, catalog.GPU_ENERGY_JOULES_TOTAL) == 500.0 and val(reg, catalog.WINDOW_OPEN) == 1


def test_a_named_adapters_result_ends_its_live_series_not_the_nights() -> None:
    """The child goes on with the next adapter after one adapter's result: the run is still in progress,
    the card's readings stay; the child's exit ends it."""
    reg = CollectorRegistry()
    m = two(reg)
    m.on_child_start()
    m.on_event(PhaseEvent(ts=T0, adapter="support", phase=Phase.train, state="start"))
    m.on_event(ProgressEvent(ts=T0 + 1, adapter="support", version=3, fraction=0.5, tokens=100, samples=2))
    m.on_event(gpu_event(T0 + 1, 1_000.0))
    assert val(reg, catalog.RUN_PHASE, adapter="support", phase="train") == 1
    m.on_event(ResultEvent(ts=T0 + 2, adapter="support", summary=summary(adapter="support")))
    assert val(reg, catalog.RUN_PROGRESS_RATIO, adapter="support") is None
    assert val(reg, catalog.RUN_IN_PROGRESS) == 1 and val(reg, catalog.GPU_POWER_WATTS) == 250.0
    m.on_event(PhaseEvent(ts=T0 + 3, adapter="legal", phase=Phase.train, state="start"))
    m.on_event(ProgressEvent(ts=T0 + 4, adapter="legal", version=3, fraction=0.25, tokens=50, samples=1))
    assert label_sets(reg, catalog.RUN_PHASE) == [{"adapter": "legal", "phase": "train"}]  # one phase at a time
    assert val(reg, catalog.RUN_PROGRESS_RATIO, adapter="legal") == 0.25
    assert val(reg, catalog.TRAINED_TOKENS_TOTAL, adapter="legal") == 50  # not support's version 3 high water
    m.on_child_exit()
    assert val(reg, catalog.RUN_IN_PROGRESS) == 0
    assert not label_sets(reg, catalog.RUN_PROGRESS_RATIO) and not label_sets(reg, catalog.RUN_PHASE)
    assert val(reg, catalog.LAST_RUN_OUTCOME, adapter="support", outcome="succeeded") == 1  # stays


def test_the_whole_nights_summary_ends_the_run_and_counts_no_run_of_its_own() -> None:
    """A night of several adapters ends with the night's own summary (adapter "", each adapter's inside): every
    adapter was counted from its own result, so that one ends the run and counts nothing twice."""
    reg = CollectorRegistry()
    m = two(reg)
    m.on_child_start()
    each = [summary(adapter=a, run_id=f"r-{a}", outcome=o) for a, o in (("support", "succeeded"),
                                                                       ("legal", "rejected"))]
    for s in each:
        m.on_event(ResultEvent(ts=T0, adapter=s.adapter, summary=s))
    assert val(reg, catalog.RUN_IN_PROGRESS) == 1
    night = summary(adapter="", run_id="r-night", outcome="succeeded").model_copy(update={"adapters": each})
    m.on_event(ResultEvent(ts=T0 + 1, summary=night))
    assert val(reg, catalog.RUN_IN_PROGRESS) == 0
    assert val(reg, catalog.RUNS_TOTAL, adapter="support", outcome="succeeded") == 1
    assert val(reg, catalog.RUNS_TOTAL, adapter="legal", outcome="rejected") == 1
    assert val(reg, catalog.RUNS_TOTAL, outcome="succeeded") is None  # no run of the night's own
    assert val(reg, catalog.LAST_RUN_OUTCOME, outcome="succeeded") is None


def test_only_configured_adapter_names_become_label_values() -> None:
    """The label's cardinality is the config's: a name nobody configured is logged and dropped, not a new series."""
    reg = CollectorRegistry()
    m = two(reg)
    m.on_summary(summary(adapter="intruder"))
    m.on_event(ProgressEvent(ts=T0, adapter="intruder", version=1, fraction=0.5, tokens=10))
    m.on_hotswap("vllm", False, adapter="intruder")
    m.set_backlog(5, 50, adapter="intruder")
    m.restore(last_success=T0, adapter="intruder")
    adapters = {s.labels.get("adapter") for f in reg.collect() for s in f.samples}
    assert adapters == {None, "support", "legal"}
    # a failure of the whole night (the child died before naming an adapter) is still counted, under ""
    m.on_summary(summary(run_id="crash", outcome="failed", adapter="", version=None))
    assert val(reg, catalog.RUNS_TOTAL, outcome="failed") == 1
    assert val(reg, catalog.RUNS_TOTAL, adapter="support", outcome="failed") == 0


def test_a_config_of_one_adapter_exposes_no_adapter_label() -> None:
    """Backward compatible: the same series identities as before the label (Prometheus drops an empty label)."""
    reg = CollectorRegistry()
    m = NightshiftMetrics(reg, sources=["inbox"], hotswap_kinds=["vllm"])
    for ev in night_events(gpu=True):
        m.on_event(ev)
    text = generate_latest(reg).decode()
    assert "adapter=" not in text
    assert 'nightshift_runs_total{outcome="succeeded"} 1.0' in text
    assert "nightshift_run_duration_seconds_count 1.0" in text


def test_restore_is_per_adapter() -> None:
    reg = CollectorRegistry()
    m = two(reg)
    m.restore_last_run(summary(outcome="rejected"), adapter="legal")  # the summary of legal's own ledger
    m.restore(last_success=T0 - 86_400, last_run=T0, last_outcome="rejected", adapter="legal")
    m.restore(last_success=T0, last_run=T0, last_outcome="succeeded", adapter="support")
    m.set_backlog(3, 30, adapter="support")
    assert val(reg, catalog.LAST_SUCCESS_TIMESTAMP_SECONDS, adapter="legal") == T0 - 86_400
    assert val(reg, catalog.LAST_SUCCESS_TIMESTAMP_SECONDS, adapter="support") == T0
    assert val(reg, catalog.LAST_RUN_OUTCOME, adapter="legal", outcome="rejected") == 1
    assert val(reg, catalog.LAST_RUN_BUDGET_RATIO, adapter="legal") == pytest.approx(1.2)
    assert val(reg, catalog.LAST_RUN_BUDGET_RATIO, adapter="support") is None
    assert val(reg, catalog.BACKLOG_SAMPLES, adapter="support") == 3
    assert val(reg, catalog.BACKLOG_SAMPLES, adapter="legal") == 10  # from legal's summary


def test_the_service_labels_its_adapters_and_no_other(tmp_path) -> None:
    """The service hands the metrics the config's adapters (daemon/report_data.adapter_states), and at start
    restores each one's series from its own ledger."""
    cfg, _ = toml_config(tmp_path, tmp_path / "model")
    settings = load_settings(cfg)
    assert Service(settings, registry=CollectorRegistry()).metrics.adapters == ()  # one adapter: no label
    (tmp_path / "inbox2").mkdir()
    cfg, _ = toml_config(tmp_path, tmp_path / "model", more=f"""
[[sources]]
name = "inbox2"
inbox = "{tmp_path / 'inbox2'}"
[[adapters]]
name = "legal"
sources = ["inbox2"]
[[adapters]]
name = "support"
sources = ["inbox"]
""")
    settings = load_settings(cfg)
    led = Ledger(StatePaths(settings.state_dir).adapter("legal").ledger)  # legal has a night; support none yet
    try:
        led.start_run("r1", "2026-11-27", T0 + 3_600)
        led.finish_run("r1", "rejected", summary=summary(adapter="legal", run_id="r1", outcome="rejected",
                                                         backlog_samples=7))
    finally:
        led.close()
    reg = CollectorRegistry()
    service = Service(settings, registry=reg)
    assert service.metrics.adapters == ("legal", "support")
    assert val(reg, catalog.RUNS_TOTAL, adapter="legal", outcome="rejected") == 0  # each adapter's counters at 0
    assert val(reg, catalog.RUNS_TOTAL, outcome="rejected") is None
    service._restore_metrics()
    assert val(reg, catalog.LAST_RUN_OUTCOME, adapter="legal", outcome="rejected") == 1
    assert val(reg, catalog.LAST_RUN_OUTCOME, adapter="support", outcome="rejected") is None
    assert not StatePaths(settings.state_dir).adapter("support").root.exists()  # reading created nothing
