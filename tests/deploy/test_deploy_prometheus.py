"""deploy/prometheus and deploy/grafana against the real tools and against what the exporter exposes.

promtool checks the rules, runs their unit tests, lints the exporter's output; a real
Prometheus scrapes the exporter and evaluates the rules; every `nightshift_*` name in the
rules and the dashboard must be in the catalogue (daemon/metrics/catalog.py) and be a series
the exporter actually exposes, and every catalogued series must be looked at somewhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from daemon.metrics import SPECS, MetricsConfig, NightshiftMetrics, catalog, serve
from jobs.contract import ResultEvent
from tests.conftest import hang_bound
from tests.fixtures.metrics_samples import T0, hotswap_event, night_events, summary
from tests.fixtures.prom_server import NO_PROMETHEUS, NO_PROMTOOL, PROMETHEUS, PROMTOOL, prometheus_server

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
RULES = PROM_DIR / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "nightshift.json"
GRAFANA_PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
NAME = re.compile(r"\bnightshift_[a-zA-Z0-9_]+")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)


def exposed_names(reg: CollectorRegistry) -> set[str]:
    """Series names as PromQL sees them (_total, _bucket, _sum, _count, _info included)."""
    return {s.name for fam in reg.collect() for s in fam.samples}


def fed_registry(
    budget_ratio: float = 1.2, seen: set[str] | None = None
) -> tuple[CollectorRegistry, NightshiftMetrics]:
    """A registry after a whole night with a GPU and everything the daemon reports itself.

    `seen` collects every name exposed at some moment (live series vanish with the child)."""
    reg = CollectorRegistry()
    seen = set() if seen is None else seen
    m = NightshiftMetrics(reg, sources=["inbox"], hotswap_kinds=["vllm", "webhook"])
    m.set_window(True, T0 + 86_400, end=T0 + 3_600)
    for ev in night_events(gpu=True)[:-1]:
        m.on_event(ev)
        seen |= exposed_names(reg)
    m.on_event(hotswap_event("vllm", True))
    m.on_event(ResultEvent(ts=T0 + 48, summary=summary(actual_train_seconds=30.0 * budget_ratio)))
    m.on_hotswap("webhook", False)
    m.set_window(False, T0 + 86_400)
    m.set_backlog(10, 4_000)
    seen |= exposed_names(reg)
    return reg, m


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r.get("alert") or r["record"]: r["expr"] for g in groups for r in g["rules"]}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_exprs(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(d) for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=hang_bound(60))


# ---- promtool ------------------------------------------------------------------------------
@needs_promtool
def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 10 rules found" in out.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    out = promtool("test", "rules", str(PROM_DIR / "rules_test.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_every_alert_has_unit_tests_firing_and_not_firing() -> None:
    tests = yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for alert in rule_exprs():
        assert any(c["alertname"] == alert and c["exp_alerts"] for c in cases), f"{alert}: no firing case"
        assert any(c["alertname"] == alert and not c["exp_alerts"] for c in cases), f"{alert}: no silent case"


@needs_promtool
def test_promtool_check_config_of_the_scrape_snippet() -> None:
    out = promtool("check", "config", str(PROM_DIR / "scrape.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_check_metrics_on_the_live_endpoint_passes_without_warnings() -> None:
    reg, _ = fed_registry()
    srv = serve(MetricsConfig(port=0), reg)
    assert srv is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        srv.close()
    assert catalog.GPU_ENERGY_JOULES_TOTAL in text and f"{catalog.RUN_DURATION_SECONDS}_bucket" in text
    out = promtool("check", "metrics", stdin=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


@needs_promtool
def test_promtool_check_metrics_on_a_fresh_registry_and_without_a_gpu() -> None:
    for feed in (False, True):
        reg = CollectorRegistry()
        m = NightshiftMetrics(reg)
        if feed:
            for ev in night_events(gpu=False):
                m.on_event(ev)
        out = promtool("check", "metrics", stdin=generate_latest(reg).decode())
        assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


@needs_promtool
def test_promtool_check_metrics_with_two_adapters_and_a_failure_of_the_whole_night() -> None:
    reg = CollectorRegistry()
    m = NightshiftMetrics(reg, adapters=["support", "legal"], hotswap_kinds=["vllm"], sources={"support": ["inbox"]})
    for ev in night_events(gpu=True)[:-1]:
        m.on_event(ev.model_copy(update={"adapter": "support"}))
    m.on_summary(summary(adapter="support"))
    m.on_summary(summary(adapter="", run_id="crash", outcome="failed"))  # the child died: no adapter named
    text = generate_latest(reg).decode()
    assert 'adapter="support"' in text and 'adapter="legal"' in text
    out = promtool("check", "metrics", stdin=text)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


@needs_promtool
def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query, written as a recording rule with Grafana's variables filled in."""
    exprs = [e.replace("$instance", "127.0.0.1:9464").replace("$adapter", ".*") for e in dashboard_exprs(dashboard())]
    exprs = [e for e in exprs if not e.startswith("label_values(")]  # Grafana's own function
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


# ---- names -------------------------------------------------------------------------------------
def used_names() -> set[str]:
    """Every `nightshift_*` name the alert rules and the dashboard query."""
    return {n for e in [*rule_exprs().values(), *dashboard_exprs(dashboard())] for n in NAME.findall(e)}


def test_every_metric_in_the_rules_and_the_dashboard_is_catalogued_and_exported() -> None:
    exported: set[str] = set()
    fed_registry(seen=exported)
    used = used_names()
    assert len(used) > 30
    uncatalogued = sorted(used - catalog.SERIES)
    assert not uncatalogued, f"referenced but not in daemon/metrics/catalog.py: {uncatalogued}"
    missing = sorted(used - exported)
    assert not missing, f"referenced but not exported: {missing}"
    assert exported <= catalog.SERIES, f"exported but not catalogued: {sorted(exported - catalog.SERIES)}"


def test_every_catalogued_metric_is_on_the_dashboard_or_in_a_rule() -> None:
    """Not required by Prometheus, but a series nobody looks at is usually a mistake (a histogram
    counts as looked at through any of the series it exposes: _bucket, _sum, _count)."""
    used = used_names()
    unseen = [spec.name for spec in SPECS if not used & set(spec.series()) - {f"{spec.name}_created"}]
    assert not unseen


# ---- Grafana -------------------------------------------------------------------------------------
def test_dashboard_provisions_from_file() -> None:
    raw = DASHBOARD.read_text()
    assert "DS_PROMETHEUS" not in raw and "__inputs" not in raw  # file provisioning does not resolve those
    d = json.loads(raw)
    assert d["uid"] == "nightshift" and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    for p in panels(d):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == ds, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ds and t["expr"] and '{instance="$instance"' in t["expr"], p["title"]
    titles = " ".join(p["title"].lower() for p in panels(d))
    for wanted in (
        "outcome",
        "phase",
        "throughput",
        "vram",
        "power",
        "energy",
        "predicted vs actual",
        "backlog",
        "adapter in service",
        "losses",
    ):
        assert wanted in titles, wanted


SELECTOR = re.compile(r"\b(nightshift_[a-z0-9_]+)(\{[^}]*\})?")


def test_the_dashboard_filters_every_adapters_series_by_the_adapter_variable() -> None:
    """Issue 43: a multi-select `adapter` variable (All matches a config of one adapter, which has no label);
    every series of a run or a version is filtered by it and split by it in its legend, the night's are not."""
    d = dashboard()
    var = {v["name"]: v for v in d["templating"]["list"]}["adapter"]
    assert var["type"] == "query" and var["multi"] and var["includeAll"] and var["allValue"] == ".*"
    query = var["query"]["query"]
    assert re.fullmatch(r"label_values\(nightshift_[a-z_]+\{instance=\"\$instance\"\}, adapter\)", query)
    per_adapter = 0
    for p in panels(d):
        for t in p.get("targets", []):
            for name, matchers in SELECTOR.findall(t["expr"]):
                base = next(n for n in (name, *(name.removesuffix(s) for s in ("_bucket", "_sum", "_count")))
                            if n in catalog.BY_NAME)
                filtered = 'adapter=~"$adapter"' in (matchers or "")
                assert filtered == (base not in catalog.NIGHT_WIDE), (p["title"], t["expr"])
                per_adapter += filtered
            if "adapter=~" in t["expr"]:
                assert "by (" not in t["expr"] or "by (adapter," in t["expr"], t["expr"]
                assert "{{adapter}}" in t["legendFormat"] or "{{name}}" in t["legendFormat"], t
    assert per_adapter > 30


def test_grafana_provisioning_yaml() -> None:
    provider = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "nightshift.yml").read_text())
    assert provider["apiVersion"] == 1
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"]
    source = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.example.yml").read_text())
    assert source["datasources"][0]["type"] == "prometheus"


# ---- a real Prometheus ------------------------------------------------------------------------
@needs_prometheus
def test_prom_server_helper_finds_a_known_value(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    Gauge("selftest_known_value", "A value the test knows.", registry=reg).set(42.5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        target = f"127.0.0.1:{server.server_port}"
        with prometheus_server([target], tmp_path / "prom", job="selftest") as prom:
            result = prom.wait_for('selftest_known_value{job="selftest"}')
            assert result[0]["metric"]["instance"] == target
            assert prom.value("selftest_known_value") == 42.5
            assert prom.value('up{job="selftest"}') == 1.0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@needs_prometheus
def test_prometheus_scrapes_the_exporter_and_evaluates_the_rules(tmp_path: Path) -> None:
    reg, _ = fed_registry(budget_ratio=1.5)
    srv = serve(MetricsConfig(port=0), reg)
    assert srv is not None
    try:
        with prometheus_server([f"127.0.0.1:{srv.port}"], tmp_path / "prom", rule_files=[RULES]) as prom:
            prom.wait_for('nightshift_runs_total{outcome="succeeded"}')
            assert prom.value('nightshift_runs_total{outcome="succeeded"}') == 1.0
            # the dashboard's adapter variable at All (.*) matches a config of one adapter (no adapter label)
            assert prom.value('nightshift_runs_total{outcome="succeeded", adapter=~".*"}') == 1.0
            assert prom.value("nightshift_trained_tokens_total") == 54_000
            assert prom.value("nightshift_gpu_energy_joules_total") == 500.0
            assert prom.value("nightshift_last_run_budget_ratio") == pytest.approx(1.5)
            assert prom.value("nightshift_run_duration_seconds_count") == 1.0
            info = prom.query("nightshift_adapter_info")
            assert info[0]["metric"]["name"] == "tiny-v0003"
            expected = {"NightshiftBudgetError", "NightshiftHotswapFailing"}
            # each rule's ALERTS samples are committed on their own: wait for both, not for any two
            alerts = prom.wait_for(
                'ALERTS{alertstate="firing"}', lambda r: expected <= {a["metric"]["alertname"] for a in r}
            )
            firing = {a["metric"]["alertname"] for a in alerts}
            assert expected <= firing
            assert "NightshiftVramPeakHigh" not in firing and "NightshiftLastRunFailed" not in firing
    finally:
        srv.close()


@needs_prometheus
def test_prometheus_alerts_for_the_adapter_at_fault_only(tmp_path: Path) -> None:
    """Two adapters in one daemon: the one whose prediction missed alerts, with its name; the other does not."""
    reg = CollectorRegistry()
    m = NightshiftMetrics(reg, adapters=["support", "legal"], hotswap_kinds=["vllm"])
    m.on_summary(summary(adapter="support", actual_train_seconds=45.0))  # 1.5x the predicted 30 s
    m.on_summary(summary(adapter="legal", version_name="legal-v0003", actual_train_seconds=30.0))
    m.on_hotswap("vllm", False, adapter="legal")
    srv = serve(MetricsConfig(port=0), reg)
    assert srv is not None
    try:
        with prometheus_server([f"127.0.0.1:{srv.port}"], tmp_path / "prom", rule_files=[RULES]) as prom:
            prom.wait_for('nightshift_last_run_budget_ratio{adapter="legal"}')
            assert prom.value('nightshift_last_run_budget_ratio{adapter="support"}') == pytest.approx(1.5)
            alerts = prom.wait_for('ALERTS{alertstate="firing"}', lambda r: {"NightshiftBudgetError",
                                   "NightshiftHotswapFailing"} <= {a["metric"]["alertname"] for a in r})
            fired = sorted((a["metric"]["alertname"], a["metric"].get("adapter")) for a in alerts
                           if a["metric"]["alertname"] in ("NightshiftBudgetError", "NightshiftHotswapFailing"))
            assert fired == [("NightshiftBudgetError", "support"), ("NightshiftHotswapFailing", "legal")]
    finally:
        srv.close()


def test_the_scrape_snippet_reads_the_capture_where_it_serves_its_counters() -> None:
    """The capture's counters (captured requests, feedback, records: issue 45) had no scrape job."""
    from jobs.capture.config import CaptureConfig

    jobs = {j["job_name"]: j for j in yaml.safe_load((PROM_DIR / "scrape.yml").read_text())["scrape_configs"]}
    capture = jobs["nightshift-capture"]
    assert capture["metrics_path"] == "/nightshift/metrics"
    assert capture["static_configs"][0]["targets"] == [f"127.0.0.1:{CaptureConfig.model_fields['port'].default}"]
