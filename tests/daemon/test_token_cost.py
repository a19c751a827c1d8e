"""Joules and dollars per million trained tokens (issue 44): derived from a night's RunSummary (the card's energy,
trained_tokens, its start and end, its cards) and `[gpu] price_per_gpu_hour`, in the CLI summary, `adapters show`,
the report and the metrics. CPU, a fabricated summary with the figures of the 8B FP8 night on an H200
(RESULTS.md: 2026-11-28): 1,714,026 tokens, 53,362 J, 114 s."""

from __future__ import annotations

import json
import types

import pytest
from prometheus_client import CollectorRegistry

from daemon.metrics import NightshiftMetrics
from daemon.metrics import catalog as m
from daemon.report import summary_table
from daemon.report_data import night_row
from daemon.report_html import cards
from jobs.contract import GpuSummary, Outcome, RunSummary
from jobs.gpu.cost import summary_cost, token_cost

T = 1_795_000_000.0
TOKENS, JOULES, SECONDS, PRICE = 1_714_026, 53_362.0, 114.0, 3.5
DOLLARS = PRICE * SECONDS / 3600 / (TOKENS / 1e6)  # $0.0647 per million tokens


def night(**over) -> RunSummary:
    base = dict(run_id="2026-11-28-abc", night="2026-11-28", outcome=Outcome.succeeded, trained_tokens=TOKENS,
                gpu=GpuSummary(mean_power_watts=597.0, energy_joules=JOULES, name="NVIDIA H200"),
                started_at=T - SECONDS, ended_at=T)
    return RunSummary(**{**base, **over})


def test_joules_and_dollars_per_million_tokens_from_the_summary() -> None:
    c = summary_cost(night(), PRICE)
    assert c.joules_per_million_tokens == pytest.approx(JOULES / TOKENS * 1e6)  # 31,132 J: 31.1 J per 1k
    assert c.joules_per_1k_tokens == pytest.approx(31.13, abs=0.01)
    assert c.dollars_per_million_tokens == pytest.approx(DOLLARS)
    two = summary_cost(night(ranks=2), PRICE)  # two cards held for the night: twice the GPU-hours
    assert two.dollars_per_million_tokens == pytest.approx(2 * DOLLARS)
    assert two.gpu_hours == pytest.approx(2 * SECONDS / 3600)


def test_no_price_no_dollars_and_nothing_where_the_night_does_not_say() -> None:
    c = summary_cost(night())
    assert c.dollars_per_million_tokens is None and c.joules_per_million_tokens is not None
    assert "$" not in (c.line() or "")
    bare = summary_cost(night(gpu=None, trained_tokens=0, started_at=None), PRICE)  # a CPU night that trained nothing
    assert bare.joules_per_million_tokens is None and bare.dollars_per_million_tokens is None and bare.line() is None
    assert token_cost(tokens=10, energy_joules=None, seconds=0.0, price_per_gpu_hour=PRICE).dollars_per_million_tokens \
        is None


def test_the_cli_summary_says_it() -> None:
    priced = summary_table(night(), PRICE)
    assert "31.1 kJ per million tokens" in priced and f"${DOLLARS:,.3f} per million tokens at $3.50" in priced
    unpriced = summary_table(night())
    assert "31.1 kJ per million tokens" in unpriced and "$" not in unpriced


def test_the_metrics_have_a_gauge_per_night() -> None:
    def gauge(price: float | None) -> dict[str, float]:
        reg = CollectorRegistry()
        NightshiftMetrics(reg, price_per_gpu_hour=price).on_summary(night())
        return {s.labels["unit"]: s.value for fam in reg.collect() for s in fam.samples
                if s.name == m.LAST_RUN_COST_PER_MILLION_TOKENS}

    assert gauge(PRICE) == pytest.approx({"joules": JOULES / TOKENS * 1e6, "dollars": DOLLARS})
    assert gauge(None) == pytest.approx({"joules": JOULES / TOKENS * 1e6})  # unset price: no dollars series


def test_the_report_row_and_card() -> None:
    summ = json.loads(night().model_dump_json())
    run = {"night": "2026-11-28", "id": "2026-11-28-abc", "status": "succeeded", "started_at": T - SECONDS - 5,
           "ended_at": T + 1, "error": None}
    row = night_row(run, summ, {}, price_per_gpu_hour=PRICE)
    assert row.joules_per_1k_tokens == pytest.approx(31.13, abs=0.01)
    assert row.dollars_per_million_tokens == pytest.approx(DOLLARS)  # the summary's own start and end
    html = cards(types.SimpleNamespace(nights=[row]))
    assert "per million tokens" in html and f"${DOLLARS:,.3f}" in html and "31.1 kJ" in html
    assert night_row(run, summ, {}).dollars_per_million_tokens is None


def test_adapters_show_says_it(tmp_path) -> None:
    from daemon.adapters_cli import _cost

    row = {"summary": night().model_dump_json()}
    ad = types.SimpleNamespace(ledger=types.SimpleNamespace(run=lambda rid: row if rid == "2026-11-28-abc" else None),
                               price_per_gpu_hour=PRICE)
    assert f"${DOLLARS:,.3f}" in _cost(ad, {"run_id": "2026-11-28-abc"})
    assert _cost(ad, {"run_id": "elsewhere"}) == "—"


def test_a_bad_price_is_named(tmp_path) -> None:
    from daemon.settings import load_settings
    from tests.conftest import toml_config

    for bad in ("0", "-1.5", '"two dollars"'):
        cfg, _ = toml_config(tmp_path, tmp_path / "model", more=f"[gpu]\nprice_per_gpu_hour = {bad}\n")
        with pytest.raises(Exception, match=r"\[gpu\] price_per_gpu_hour"):
            load_settings(cfg)
    cfg, _ = toml_config(tmp_path, tmp_path / "model", more="[gpu]\nprice_per_gpu_hour = 2.75\n")
    assert load_settings(cfg).gpu.price_per_gpu_hour == 2.75
