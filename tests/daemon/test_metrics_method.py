"""The training method in the metrics: how the last run trained, and what kind of version is in service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from daemon.metrics import NightshiftMetrics, catalog
from jobs.contract import Method
from tests.fixtures.metrics_samples import summary

PLAN = {"key": "k", "train_ids": [1], "heldout_ids": [], "train_tokens": 10, "deferred_samples": 0,
        "deferred_tokens": 0, "tokens_per_second": 1.0, "overhead_seconds": 0.0, "available_seconds": 1.0,
        "predicted_train_seconds": 1.0, "epochs": 1, "basis": "b", "measured": False, "backend": "unsloth"}


def labels(reg: CollectorRegistry, name: str) -> list[dict[str, str]]:
    return [s.labels for f in reg.collect() for s in f.samples if s.name == name]


def test_last_run_info_and_adapter_info_carry_the_method() -> None:
    reg = CollectorRegistry()
    m = NightshiftMetrics(reg)
    m.on_summary(summary(run_id="r1", method="full", plan=PLAN))
    assert labels(reg, "nightshift_last_run_info") == [{"method": "full", "backend": "unsloth"}]
    assert labels(reg, "nightshift_adapter_info") == [
        {"version": "3", "name": "tiny-v0003", "base_model": "/models/qwen", "method": "full"}]
    m.on_summary(summary(run_id="r2", method="lora", plan=PLAN, version=4, version_name="tiny-v0004"))
    assert labels(reg, "nightshift_last_run_info") == [{"method": "lora", "backend": "unsloth"}]  # one at a time
    assert labels(reg, "nightshift_adapter_info")[0]["method"] == "lora"
    m.on_summary(summary(run_id="r3", outcome="skipped", promoted=False, version=None, method=None))  # no training
    assert labels(reg, "nightshift_last_run_info") == [{"method": "lora", "backend": "unsloth"}]
    assert set(catalog.METHODS) == {x.value for x in Method}
