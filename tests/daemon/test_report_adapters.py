"""`nightshift report` with several adapters (issue 43): each adapter's ledger (`<state_dir>/by-adapter/<name>/`)
read into its own section with its versions, outcomes, gate checks, KL and loss curve; found and read without
creating anything; the page self-contained and drawn by a real headless Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.report_data import adapter_states, collect_adapters
from daemon.report_html import render
from daemon.settings import load_settings
from jobs.store.ledger import Ledger
from jobs.store.paths import StatePaths
from tests.conftest import toml_config
from tests.daemon.test_readonly_commands import tree
from tests.daemon.test_report import SECTIONS, page_is_self_contained
from tests.fixtures.chromium import Chromium, find_chromium
from tests.fixtures.metrics_samples import T0, summary

REJECTED_GATE = {"passed": False, "checks": [
    {"name": "heldout.loss", "before": 1.1, "after": 1.4, "change": 0.3, "change_pct": 27.3, "rule": "<= +1 %",
     "passed": False},
    {"name": "regression.loss", "before": 3.0, "after": 3.0, "change": 0.0, "change_pct": 0.0, "rule": "<= +1 %",
     "passed": True}]}


def fabricate(state: Path, adapter: str, outcomes: list[str], kl: float) -> None:
    """One adapter's ledger: a run per outcome, a day apart; the ones that published have a version whose
    manifest keeps a loss curve."""
    state.mkdir(parents=True, exist_ok=True)
    now = [T0]
    led = Ledger(StatePaths(state).ledger, clock=lambda: now[0])
    try:
        for i, outcome in enumerate(outcomes, 1):
            now[0] = T0 + 86_400 * i
            run_id, name = f"2026-11-2{i}-{adapter}", f"{adapter}-v{i:04d}"
            led.start_run(run_id, f"2026-11-2{i}", now[0] + 3_600)
            published = outcome in ("succeeded", "rejected")
            if published:
                manifest = {"name": name, "loss_curve": [{"step": s, "loss": 3.0 - s / 10 - i / 100} for s in range(8)]}
                led.db.execute("INSERT INTO versions (version, name, run_id, status, created_at, manifest) "
                               "VALUES (?,?,?,?,?,?)", (i, name, run_id, "promoted" if outcome == "succeeded"
                                                        else "rejected", now[0], json.dumps(manifest)))
                led.db.execute("UPDATE runs SET version=? WHERE id=?", (i, run_id))
            now[0] += 60
            over = {"gate": REJECTED_GATE, "promoted": False} if outcome == "rejected" else {}
            s = summary(adapter=adapter, run_id=run_id, night=f"2026-11-2{i}", outcome=outcome,
                        version=i if published else None, version_name=name if published else None,
                        kl_from_service=kl * i, trained_samples=10 * i, backlog_samples=i,
                        **over)
            led.finish_run(run_id, outcome, summary=s)
    finally:
        led.close()


ADAPTERS = """
[[sources]]
name = "inbox2"
inbox = "{inbox2}"
settle_seconds = 0
[[adapters]]
name = "legal"
sources = ["inbox2"]
[[adapters]]
name = "support"
sources = ["inbox"]
"""


@pytest.fixture
def two_adapters(tmp_path: Path) -> Path:
    """A config of two adapters ([[adapters]] legal, support) whose ledgers hold a few nights each."""
    (tmp_path / "inbox2").mkdir()
    cfg, _ = toml_config(tmp_path, tmp_path / "model", more=ADAPTERS.format(inbox2=tmp_path / "inbox2"))
    state = StatePaths(tmp_path / "state")
    fabricate(state.adapter("support").root, "support", ["succeeded", "rejected", "succeeded"], kl=0.01)
    fabricate(state.adapter("legal").root, "legal", ["rejected", "skipped"], kl=0.2)
    return cfg


def test_adapter_states_are_the_configs_adapters_and_create_nothing(tmp_path: Path, two_adapters: Path) -> None:
    settings = load_settings(two_adapters)
    state = StatePaths(settings.state_dir)
    assert adapter_states(settings) == [("legal", state.adapter("legal")), ("support", state.adapter("support"))]
    # a config of one adapter: its state directory, whether it exists or not, and nothing is created
    lone = tmp_path / "lone"
    (lone / "adapters" / "tiny-v0001").mkdir(parents=True)
    missing = tmp_path / "missing"
    before = tree(lone)
    for root in (lone, missing):
        one = settings.model_copy(update={"state_dir": root, "adapters": []})
        assert adapter_states(one) == [("", StatePaths(root))]
    assert tree(lone) == before and not missing.exists()


def test_collect_reads_each_adapters_ledger_into_its_own_report(two_adapters: Path) -> None:
    settings = load_settings(two_adapters)
    r = collect_adapters(adapter_states(settings), settings.state_dir, 14)
    assert r.nights == [] and [a.adapter for a in r.adapters] == ["legal", "support"]
    legal, support = r.adapters
    assert [n.outcome for n in support.nights] == ["succeeded", "rejected", "succeeded"]
    assert [n.outcome for n in legal.nights] == ["rejected", "skipped"]
    assert {n.adapter for n in support.nights} == {"support"} and {n.adapter for n in legal.nights} == {"legal"}
    assert [n.version_name for n in support.nights] == ["support-v0001", "support-v0002", "support-v0003"]
    assert support.nights[1].gate is not None and support.nights[1].gate.passed is False
    assert [n.kl_from_service for n in legal.nights] == [pytest.approx(0.2), pytest.approx(0.4)]
    assert support.loss_curve_version == "support-v0003" and legal.loss_curve_version == "legal-v0001"
    assert r.night_count() == 5
    # --nights counts per adapter
    short = collect_adapters(adapter_states(settings), settings.state_dir, 1)
    assert [[n.night for n in a.nights] for a in short.adapters] == [["2026-11-22"], ["2026-11-23"]]


def test_the_page_has_one_section_per_adapter(two_adapters: Path) -> None:
    settings = load_settings(two_adapters)
    html = render(collect_adapters(adapter_states(settings), settings.state_dir, 14))
    page_is_self_contained(html)
    ids = re.findall(r'\sid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), "chart ids repeat across the adapters' sections"
    sections = re.findall(r'<section class="adapter" id="([^"]+)"><h2>Adapter ([a-z]+)</h2>', html)
    assert [name for _, name in sections] == ["legal", "support"]
    support = html[html.index('id="a1-support"'):]
    legal = html[html.index('id="a0-legal"'):html.index('id="a1-support"')]
    for part in (legal, support):  # every section of the single-adapter page, inside each adapter's
        for title in [*SECTIONS, "Nights"]:
            assert f'<h3 class="section">{title.replace(chr(39), "&#x27;")}</h3>' in part, title
    assert "chart-forgetting-kl" in support and "chart-loss-curve" in legal
    assert "support-v0003" in support and "support-v0003" not in legal
    assert "heldout.loss 1.1 -&gt; 1.4 (&lt;= +1 %)" in legal  # the failed gate check, with its figures
    assert "regression.loss" not in legal  # a check that passed is not a reason
    overview = html[html.index("<h2>Adapters</h2>"):html.index("<section")]
    assert overview.count("<tr>") == 3 and 'href="#a0-legal"' in overview


def test_report_cli_reads_every_adapter_and_changes_nothing(two_adapters: Path, tmp_path: Path, capsys) -> None:
    state = tmp_path / "state"
    before = tree(state)
    main(["--config", str(two_adapters), "report", "--json", "--nights", "2"])
    data = json.loads(capsys.readouterr().out)
    assert [(a["adapter"], len(a["nights"])) for a in data["adapters"]] == [("legal", 2), ("support", 2)]
    assert tree(state) == before


@pytest.mark.skipif(find_chromium() is None,
                    reason="needs Debian's chromium (apt-get install -y chromium; .ci/run installs it)")
def test_the_page_of_two_adapters_renders_in_a_real_headless_chromium(two_adapters: Path, tmp_path: Path,
                                                                      capsys) -> None:
    out = tmp_path / "out" / "report.html"
    main(["--config", str(two_adapters), "report", "--out", str(out)])
    assert "5 night(s) of 2 adapters" in capsys.readouterr().out
    browser = Chromium(find_chromium(), tmp_path / "chromium-profile")
    try:
        browser.open(out.as_uri())
        assert browser.evaluate("[...document.querySelectorAll('section.adapter > h2')].map(h => h.textContent)") \
            == ["Adapter legal", "Adapter support"]
        per_section = browser.evaluate("[...document.querySelectorAll('section.adapter')].map(s => "
                                       "[s.querySelectorAll('figure.chart svg.plot').length, "
                                       "s.querySelectorAll('table tr').length])")
        assert per_section[0][1] == 3 and per_section[1][1] == 4  # header + each adapter's own nights
        assert all(charts >= 10 for charts, _ in per_section)
        assert browser.evaluate("Math.min(...[...document.querySelectorAll('svg.plot')]"
                                ".map(s => s.getBoundingClientRect().width))") > 200
        assert browser.errors() == []
    finally:
        browser.close()
