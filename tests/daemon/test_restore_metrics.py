"""Metrics survive restarts: the last run's series come back from the ledger when the daemon starts."""

from prometheus_client import CollectorRegistry

from daemon.metrics import NightshiftMetrics
from daemon.metrics import catalog as m
from daemon.service import Service
from daemon.settings import load_settings
from jobs.contract import GpuSummary, Losses, Outcome, RunSummary
from jobs.store.ledger import Ledger
from tests.conftest import toml_config

T = 1_795_000_000.0
RESTORED = ("nightshift_last_run_", m.LAST_SUCCESS_TIMESTAMP_SECONDS, m.GPU_INFO, m.GPU_MEMORY_TOTAL_BYTES)


def full_summary(**over) -> RunSummary:
    """A run that reported every figure a last-run series shows."""
    base = dict(
        run_id="2026-11-22-abc", night="2026-11-22", outcome=Outcome.succeeded, version=3, version_name="tiny-v0003",
        promoted=True, adapter_path="/state/adapters/tiny-v0003", base_model="/models/tiny", trained_samples=900,
        trained_tokens=90_000, planned_tokens=120_000, steps=40, tokens_per_second=1500.0, samples_per_hour=54_000.0,
        predicted_train_seconds=80.0, actual_train_seconds=60.0, first_step_seconds=12.5, deferred_samples=17,
        losses=Losses(train=1.5, heldout_before=2.0, heldout_after=1.8, regression_before=2.2, regression_after=2.1),
        phase_seconds={"pull": 3.0, "plan": 0.1, "load": 5.0, "train": 60.0, "evaluate": 4.0, "publish": 1.0},
        gpu=GpuSummary(mean_power_watts=410.0, energy_joules=24_600.0, peak_allocated_bytes=30 * 10**9,
                       peak_reserved_bytes=35 * 10**9, total_memory_bytes=80 * 10**9, name="NVIDIA H100 80GB HBM3"),
        metrics={"heldout_before": {"loss": 2.0, "exact_match": 0.2, "token_accuracy": 0.5, "samples": 8.0},
                 "heldout_after": {"loss": 1.8, "exact_match": 0.6, "token_accuracy": 0.7, "samples": 8.0},
                 "regression_before": {"loss": 2.2, "exact_match": 0.9, "token_accuracy": 0.95, "samples": 40.0},
                 "regression_after": {"loss": 2.1, "exact_match": 0.9, "token_accuracy": 0.95, "samples": 40.0}},
        kl_from_service=0.012, method="qlora", started_at=T - 100, ended_at=T, deadline=T - 30)
    return RunSummary(**{**base, **over})


def samples(reg: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name.startswith(RESTORED):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_last_run_series_comes_back_from_the_ledger_after_a_restart(tmp_path):
    cfg, _ = toml_config(tmp_path, tmp_path / "model", more='[window]\nsave_margin_minutes = 5\nmin_run_minutes = 1\n')
    settings = load_settings(cfg)
    summary = full_summary()
    led = Ledger(settings.state_dir / "ledger.sqlite", clock=lambda: T)
    led.start_run(summary.run_id, summary.night, summary.deadline)
    led.finish_run(summary.run_id, "succeeded", summary=summary)
    led.close()

    live = CollectorRegistry()  # what the daemon exported when the night ended
    metrics = NightshiftMetrics(live)
    metrics.set_window(True, T + 86_400, end=summary.deadline + 300)
    metrics.on_summary(summary)

    restarted = CollectorRegistry()
    Service(settings, registry=restarted)._restore_metrics()
    got, want = samples(restarted), samples(live)
    assert got == want
    catalogued = {s.name for s in m.SPECS if s.name.startswith("nightshift_last_run_")}
    assert catalogued <= {name for name, _ in got}  # every last-run series, none left blank
    assert got[(m.LAST_RUN_TRAINED_TOKENS_RATIO, ())] == 0.75 and got[(m.LAST_RUN_OVERRUN_SECONDS, ())] == 0


def test_a_run_the_daemon_closed_keeps_its_figures_under_the_ledgers_outcome(tmp_path):
    """Interrupted at the window's end and closed as failed: the outcome is the ledger's, no budget ratio."""
    cfg, _ = toml_config(tmp_path, tmp_path / "model")
    settings = load_settings(cfg)
    summary = full_summary(outcome=Outcome.interrupted)
    led = Ledger(settings.state_dir / "ledger.sqlite", clock=lambda: T)
    led.start_run(summary.run_id, summary.night, summary.deadline)
    led.finish_run(summary.run_id, "failed", summary=summary, error="the window ended before the run finished")
    led.close()
    reg = CollectorRegistry()
    Service(settings, registry=reg)._restore_metrics()
    got = samples(reg)
    assert got[(m.LAST_RUN_OUTCOME, (("outcome", "failed"),))] == 1
    assert (m.LAST_RUN_BUDGET_RATIO, ()) not in got and (m.LAST_RUN_TRAINED_TOKENS_RATIO, ()) not in got
    assert got[(m.LAST_RUN_TOKENS_PER_SECOND, ())] == 1500.0
