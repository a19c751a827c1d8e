"""A real Prometheus scraping a real `nightshift run` through a tiny-model CPU night.

One daemon, one night and one Prometheus for the whole module (the night is the slow
part): the daemon is a subprocess on a window that opens seconds after it starts, the
Prometheus (tests/prom_server.py) scrapes it every second from before the window opens
until after the run. The tests then compare what Prometheus stored with the ledger and
the manifest, lint the live /metrics text with promtool, and stop the daemon as systemd
does.

The night's live series exist only between the child's first event and its result: on this
tiny CPU night that is often less than one scrape interval (pull to publish in ~0.8 s), so
whether a 1 s scrape landed inside it was a coin toss. The night therefore announces its
adapter to a `command` hot-swap target that waits for a gate file: the child sits in its
hotswap phase, its run in progress, until Prometheus has stored that, and only then does the
fixture open the gate.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from jobs.store.ledger import Ledger
from tests.conftest import alpaca, hang_bound, write_jsonl
from tests.fixtures.daemon_proc import runs, start, wait_for, write_config
from tests.fixtures.prom_server import NO_PROMETHEUS, NO_PROMTOOL, PROMETHEUS, PROMTOOL, PromServer, prometheus_server

pytestmark = pytest.mark.slow

GOOD_SAMPLES = 20
# seconds from the config to the window: the daemon's start and Prometheus' first scrape (~5 s after it
# starts: its discovery manager batches target updates) fit before it
OPENS_IN = 12
BAD_LINES = 1
# the hot-swap command: waits for the gate file, then writes down the adapter it was told about
GATE_SCRIPT = """
import os, sys, time
gate, told = sys.argv[1:3]
while not os.path.exists(gate):
    time.sleep(0.05)
with open(told, "w") as f:
    f.write(os.environ["NIGHTSHIFT_ADAPTER_NAME"])
"""
LIVE = 'nightshift_run_phase{phase="hotswap"} == 1 and on (instance, job) nightshift_run_in_progress == 1'


@dataclass
class LiveNight:
    proc: subprocess.Popen[str]
    state: Path
    metrics_url: str
    prom: PromServer | None
    run: dict[str, Any]
    summary: dict[str, Any]
    manifest: dict[str, Any]
    ledger: dict[str, Any]
    metrics_text: str
    stderr: list[str] = field(default_factory=list)
    scraped_closed_window: bool = False  # Prometheus' first scrape came before the window opened
    hotswap_told: str | None = None  # the adapter name the hot-swap command received


def metrics_url(lines: list[str]) -> str:
    for line in lines:
        if '"metrics_serving"' in line:
            return str(json.loads(line)["url"])
    raise AssertionError("no metrics_serving line")


def ledger_facts(state: Path, run_id: str) -> dict[str, Any]:
    led = Ledger(state / "ledger.sqlite")
    try:
        db = led.db
        trained = db.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM samples WHERE status='trained'")
        n_trained, trained_tokens = trained.fetchone()
        quarantined = dict(db.execute("SELECT reason, COUNT(*) FROM quarantine GROUP BY reason").fetchall())
        return {
            "samples": dict(db.execute("SELECT source, COUNT(*) FROM samples GROUP BY source").fetchall()),
            "trained_samples": n_trained,
            "trained_tokens": trained_tokens,
            "quarantined": quarantined,
            "files": db.execute("SELECT COUNT(*) FROM files").fetchone()[0],
            "phases": dict(db.execute("SELECT phase, seconds FROM phases WHERE run_id=?", (run_id,)).fetchall()),
            "backlog": led.backlog(),
        }
    finally:
        led.close()


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=hang_bound(10)) as r:
        return r.read().decode()


def gated_hotswap(gate: Path, told: Path) -> str:
    """A [[hotswap.targets]] command that holds the night in its hotswap phase until `gate` exists."""
    argv = [sys.executable, "-c", GATE_SCRIPT, str(gate), str(told)]
    return f"""
[[hotswap.targets]]
kind = "command"
name = "gate"
argv = {json.dumps(argv)}
timeout_s = 300
retries = 0
"""


@pytest.fixture(scope="module")
def live_night(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LiveNight]:
    tmp = tmp_path_factory.mktemp("live")
    cfg, inbox = write_config(tmp, tiny_model, opens_in=OPENS_IN, lasts=300)
    gate, told = tmp / "hotswap-gate", tmp / "hotswap-told"
    cfg.write_text(cfg.read_text() + gated_hotswap(gate, told))
    records: list[Any] = [alpaca(i) for i in range(GOOD_SAMPLES)]
    records.insert(5, '{"instruction": "cut off')  # planted: one line that is not JSON
    write_jsonl(inbox / "a.jsonl", records)
    state = tmp / "state"
    with ExitStack() as stack:
        proc = start(cfg)
        stack.callback(proc.wait, 10)
        stack.callback(proc.kill)
        stack.callback(gate.touch)  # whatever happens, the night is never left waiting on the gate
        lines = proc.lines  # start() drains the daemon's stderr
        wait_for(lambda: any('"metrics_serving"' in x for x in lines), 60, "the metrics_serving log line", proc)
        url = metrics_url(lines)
        prom, scraped_closed_window = None, False
        if PROMETHEUS is not None:
            target = url.removeprefix("http://").removesuffix("/metrics")
            prom = stack.enter_context(prometheus_server([target], tmp / "prom", interval="1s"))
            prom.wait_for('up{job="nightshift"} == 1')
            first = prom.wait_for("nightshift_window_open")
            scraped_closed_window = first[0]["value"][1] == "0"
            # the child waits in its hotswap phase until Prometheus has stored the run in progress
            wait_for(lambda: bool(prom.query(LIVE)), 180, "Prometheus to see the run in progress", proc)
        else:
            wait_for(lambda: "nightshift_run_in_progress 1.0" in fetch(url), 180, "the run in progress", proc)
        gate.touch()
        wait_for(lambda: any(r["status"] == "succeeded" for r in runs(state)), 180, "a succeeded run", proc)
        (run,) = runs(state)
        if prom is not None:  # the daemon's view after the night: the result counted, the child gone
            prom.wait_for(
                'nightshift_runs_total{outcome="succeeded"} == 1 and on (instance, job) nightshift_run_in_progress == 0'
            )
            prom.wait_for("nightshift_adapter_version == 1")
        else:
            wait_for(lambda: "nightshift_adapter_version 1.0" in fetch(url), 30, "the adapter in service", proc)
        manifest = json.loads((state / "current" / "manifest.json").read_text())
        night = LiveNight(
            proc=proc,
            state=state,
            metrics_url=url,
            prom=prom,
            run=run,
            summary=json.loads(run["summary"]),
            manifest=manifest,
            ledger=ledger_facts(state, run["id"]),
            metrics_text=fetch(url),
            stderr=lines,
            scraped_closed_window=scraped_closed_window,
            hotswap_told=told.read_text() if told.exists() else None,
        )
        yield night


@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_prometheus_finds_the_nights_metrics_with_the_ledgers_values(live_night: LiveNight) -> None:
    prom, s, led, manifest = live_night.prom, live_night.summary, live_night.ledger, live_night.manifest
    assert prom is not None
    # the night itself, as the ledger has it
    assert s["outcome"] == "succeeded" and s["version"] == 1
    assert led["samples"] == {"inbox": GOOD_SAMPLES}
    assert led["quarantined"] == {"invalid_json": BAD_LINES}
    assert led["trained_samples"] == GOOD_SAMPLES == s["trained_samples"]
    assert led["backlog"] == (0, 0)

    # runs
    outcomes = {r["metric"]["outcome"]: float(r["value"][1]) for r in prom.query("nightshift_runs_total")}
    assert outcomes == {"succeeded": 1, "failed": 0, "skipped": 0, "rejected": 0, "interrupted": 0}
    assert prom.value('nightshift_last_run_outcome{outcome="succeeded"}') == 1
    assert prom.value('nightshift_last_run_outcome{outcome="failed"}') == 0
    # the child ends its summary a moment after the ledger closes the run (GPU sampler stop, backlog count)
    run = live_night.run
    assert prom.value("nightshift_last_success_timestamp_seconds") == pytest.approx(run["ended_at"], abs=2)
    assert prom.value("nightshift_last_run_timestamp_seconds") == pytest.approx(run["ended_at"], abs=2)
    assert prom.value("nightshift_run_duration_seconds_count") == 1
    duration = run["ended_at"] - run["started_at"]
    assert prom.value("nightshift_run_duration_seconds_sum") == pytest.approx(duration, abs=2)
    assert prom.value("nightshift_last_run_overrun_seconds") == 0
    assert prom.value("nightshift_window_open") == 1
    assert prom.value("nightshift_next_window_start_timestamp_seconds") > time.time()
    phases = {
        r["metric"]["phase"]: float(r["value"][1]) for r in prom.query("nightshift_last_run_phase_duration_seconds")
    }
    assert {"pull", "plan", "load", "train", "evaluate", "publish"} <= set(phases)
    assert phases == pytest.approx(s["phase_seconds"])
    assert phases["train"] == pytest.approx(led["phases"]["train"]) and phases["train"] > 0
    assert phases["publish"] == pytest.approx(led["phases"]["publish"]) and phases["publish"] > 0
    # Prometheus watched the run as it went (the hot-swap gate held it until then), and the window open
    # (when it scraped before the window opened)
    assert prom.value("max_over_time(nightshift_run_in_progress[10m])") == 1
    assert prom.value('max_over_time(nightshift_run_phase{phase="hotswap"}[10m])') == 1
    assert prom.query("nightshift_run_phase") == []  # the child is gone: no phase
    if live_night.scraped_closed_window:  # not when a loaded machine started things late
        assert prom.value("min_over_time(nightshift_window_open[10m])") == 0

    # training
    assert prom.value("nightshift_trained_samples_total") == GOOD_SAMPLES == manifest["data"]["samples"]
    tokens = prom.value("nightshift_trained_tokens_total")
    assert tokens == led["trained_tokens"] == s["trained_tokens"] == manifest["data"]["tokens"] and tokens > 0
    assert prom.value("nightshift_last_run_steps") == s["steps"] == manifest["training"]["steps"]
    tps = manifest["training"]["tokens_per_second"]
    assert tps > 0 and prom.value("nightshift_last_run_tokens_per_second") == pytest.approx(tps, rel=1e-6)
    assert prom.value("nightshift_last_run_samples_per_hour") == pytest.approx(s["samples_per_hour"])
    assert prom.value('nightshift_last_run_loss{kind="train",stage="after"}') == pytest.approx(s["losses"]["train"])

    # budget
    predicted, actual = s["predicted_train_seconds"], s["actual_train_seconds"]
    assert prom.value("nightshift_last_run_predicted_train_seconds") == pytest.approx(predicted)
    assert prom.value("nightshift_last_run_actual_train_seconds") == pytest.approx(actual)
    assert actual == pytest.approx(manifest["training"]["seconds"], abs=0.5)
    assert prom.value("nightshift_last_run_budget_ratio") == pytest.approx(actual / predicted)
    assert prom.value("nightshift_last_run_deferred_samples") == 0
    assert prom.value("nightshift_backlog_samples") == 0
    assert prom.value("nightshift_backlog_tokens") == 0

    # data
    assert prom.value('nightshift_ingested_samples_total{source="inbox"}') == GOOD_SAMPLES
    assert prom.value('nightshift_quarantined_samples_total{reason="invalid_json"}') == BAD_LINES
    assert prom.value("sum(nightshift_quarantined_samples_total)") == BAD_LINES
    assert prom.value("nightshift_ingested_files_total") == led["files"] == 1
    assert prom.value("nightshift_duplicate_samples_total") == 0

    # adapters
    assert prom.value("nightshift_adapter_version") == 1
    (info,) = prom.query("nightshift_adapter_info")
    assert info["metric"]["name"] == "tiny-v0001" and info["metric"]["version"] == "1"
    assert info["metric"]["base_model"] == manifest["base_model"]["path"]
    assert prom.value("nightshift_adapter_versions_published_total") == 1
    assert prom.value("nightshift_build_info") == 1
    # hot-swap: the command target was told about the new version, once, and it took it
    assert live_night.hotswap_told == "tiny-v0001"
    assert [(h["kind"], h["ok"]) for h in s["hotswap"]] == [("command", True)]
    assert prom.value('nightshift_hotswap_attempts_total{kind="command",outcome="success"}') == 1
    assert prom.value('nightshift_hotswap_attempts_total{kind="command",outcome="failure"}') == 0
    assert prom.value('nightshift_hotswap_consecutive_failures{kind="command"}') == 0

    # no GPU on this machine: no GPU series at all, rather than zeros
    assert prom.query('{__name__=~"nightshift_(last_run_)?gpu_.*"}') == []


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_check_metrics_on_the_live_endpoint_after_a_cpu_night(live_night: LiveNight) -> None:
    text = live_night.metrics_text
    assert 'nightshift_runs_total{outcome="succeeded"} 1.0' in text
    assert "nightshift_run_duration_seconds_bucket" in text and "nightshift_adapter_info" in text
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=hang_bound(60))
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_sigterm_after_the_night_exits_0(live_night: LiveNight) -> None:
    proc = live_night.proc
    assert proc.poll() is None, "the daemon exited before SIGTERM"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=hang_bound(60)) == 0  # and its stderr read to the end (start()'s drain)
    assert any('"stopped"' in line for line in live_night.stderr)
    assert len(runs(live_night.state)) == 1
