"""`nightshift report`: the data of the last nights, the self-contained page, and that page rendered
by a real headless Chromium (skipped with a reason where Debian's `chromium` is not installed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.report_data import CurvePoint, NightRow, Report, collect
from daemon.report_html import render
from tests.conftest import REPO, alpaca, hang_bound, run, write_jsonl
from tests.fixtures.chromium import Chromium, find_chromium, png_size

SECTIONS = ["Data", "Throughput", "Budget", "Quality and the gate", "Energy and memory", "The last night's loss curve"]


@pytest.fixture(scope="module")
def three_nights(tmp_path_factory, tiny_model):
    """Three real nights of the tiny model: one promoted, one rejected by the gate, one promoted with
    part of the data deferred (a backlog)."""
    from jobs.night.config import NightConfig

    root = tmp_path_factory.mktemp("report")
    inbox = root / "inbox"

    def cfg(**over):
        base = {"state_dir": root / "state", "model": {"path": tiny_model, "name": "tiny"},
                "sources": [{"name": "inbox", "inbox": inbox, "settle_seconds": 0}],
                "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2},
                "train": {"backend": "hf", "lora_rank": 4, "batching": "padded", "max_seq_length": 128,
                          "gradient_checkpointing": False},
                "eval": {"min_eval_samples": 2}}  # small nights: their few held-out samples are measured
        if "eval" in over:
            over = {**over, "eval": {**base["eval"], **over["eval"]}}
        return NightConfig.model_validate({**base, **over})

    write_jsonl(inbox / "n1.jsonl", [alpaca(i) for i in range(24)])
    run(cfg(), night="2026-11-19")
    write_jsonl(inbox / "n2.jsonl", [alpaca(i, " again") for i in range(24)])
    run(cfg(eval={"gate": [{"data": "heldout", "metric": "loss", "limit": 0.001}]}), night="2026-11-20")
    write_jsonl(inbox / "n3.jsonl", [alpaca(i, " once more") for i in range(40)])
    run(cfg(plan={"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2,
                  "max_samples": 12}), night="2026-11-21")
    return root


def test_collect_reads_every_figure_of_the_last_nights(three_nights):
    r = collect(three_nights / "state", 14)
    assert [n.night for n in r.nights] == ["2026-11-19", "2026-11-20", "2026-11-21"]
    assert [n.outcome for n in r.nights] == ["succeeded", "rejected", "succeeded"]
    first, rejected, last = r.nights
    assert first.trained_samples > 0 and first.tokens_per_second and first.samples_per_hour
    assert first.predicted_train_seconds and first.actual_train_seconds
    assert first.planned_tokens and first.planned_tokens_from == "summary" and first.trained_tokens > 0
    assert rejected.gate is not None and rejected.gate.passed is False and not rejected.promoted
    assert set(first.metrics) >= {"heldout_before", "heldout_after"} and first.losses["heldout_after"] is not None
    assert last.deferred_samples and last.backlog_samples == last.deferred_samples  # max_samples left some
    assert r.loss_curve and r.loss_curve_version == "tiny-v0003"  # the manifest keeps the loss per step
    assert collect(three_nights / "state", 2).nights[0].night == "2026-11-20"


def test_a_nights_row_carries_its_wake_to_first_step():
    """The summary's `first_step_seconds` (a night run as a child: from the opening, or the child's start)."""
    from daemon.report_data import night_row

    run_row = {"night": "n", "id": "r", "status": "succeeded", "started_at": 0.0, "ended_at": 1.0, "error": None}
    assert night_row(run_row, {"first_step_seconds": 16.5}, {}).first_step_seconds == 16.5
    assert night_row(run_row, {}, {}).first_step_seconds is None  # an in-process night (tests) has none


def test_report_json_and_the_state_untouched(three_nights, tmp_path):
    ledger = three_nights / "state" / "ledger.sqlite"
    before = ledger.read_bytes()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{three_nights / "state"}"\n[model]\npath = "{tmp_path}"\n')
    r = subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "report", "--json", "--nights", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=hang_bound(60))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [n["night"] for n in data["nights"]] == ["2026-11-20", "2026-11-21"]
    assert data["nights"][0]["gate"]["passed"] is False
    assert ledger.read_bytes() == before


def page_is_self_contained(html: str) -> None:
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html, re.I), "an external resource"
    assert "@import" not in html and "@font-face" not in html and "url(" not in html


def test_page_is_self_contained_with_every_section_and_placeholders():
    nights = [NightRow(night=f"2026-11-{20 + i}", run_id=f"r{i}", outcome=o, started_at=1_795_000_000 + i * 86400,
                       trained_samples=10 * i, trained_tokens=1000 * i, tokens_per_second=100.0 + i,
                       planned_tokens=1200 * i, backlog_samples=i, deferred_samples=i,
                       metrics={"heldout_before": {"loss": 2.0, "accuracy": 0.3},
                                "heldout_after": {"loss": 1.8, "accuracy": 0.35}})
              for i, o in enumerate(["succeeded", "rejected", "skipped"])]
    html = render(Report(generated_at=1_795_300_000, state_dir="/s", nights=nights,
                         loss_curve=[CurvePoint(step=s, loss=3 - s / 10) for s in range(1, 20)],
                         loss_curve_version="tiny-v0002"))
    page_is_self_contained(html)
    for title in SECTIONS:
        assert f"<h2>{title.replace(chr(39), '&#x27;')}</h2>" in html
    assert 'id="chart-quality-accuracy"' in html and 'id="chart-quality-loss"' in html
    assert "not measured (no NVIDIA GPU)" in html  # no energy here: said, not drawn as 0
    curve = html[html.index('id="chart-loss-curve"'):]
    assert '<path class="line"' in curve.split("</svg>")[0] and "tiny-v0002" in html
    html = render(Report(generated_at=0, state_dir="/s", nights=nights))
    assert "not recorded" in html[html.index('id="chart-loss-curve"'):]
    assert "No finished night yet" in render(Report(generated_at=0, state_dir="/s", nights=[]))


@pytest.mark.skipif(find_chromium() is None,
                    reason="needs Debian's chromium (apt-get install -y chromium; .ci/run installs it)")
def test_the_report_renders_in_a_real_headless_chromium(three_nights, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{three_nights / "state"}"\n[model]\npath = "{tmp_path}"\n')
    out = tmp_path / "report.html"
    r = subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "report", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=hang_bound(60))
    assert r.returncode == 0 and "3 night(s)" in r.stdout, r.stderr
    page_is_self_contained(out.read_text())

    browser = Chromium(find_chromium(), tmp_path / "chromium-profile")
    try:
        browser.open(out.as_uri())
        count = lambda sel: browser.evaluate(f"document.querySelectorAll({json.dumps(sel)}).length")  # noqa: E731
        assert count("figure.chart svg.plot") >= 10
        assert count("svg.plot rect.bar") >= 6 and count("svg.plot path.line") >= 4
        assert count("svg.plot circle.point") >= 9
        # the charts have a size on the page (drawn, not collapsed) and the sections are all there
        assert browser.evaluate("Math.min(...[...document.querySelectorAll('svg.plot')]"
                                ".map(s => s.getBoundingClientRect().width))") > 200
        assert browser.evaluate("[...document.querySelectorAll('h2')].map(h => h.textContent)") == \
            [*SECTIONS, "Nights"]
        assert browser.evaluate("document.querySelectorAll('table tr').length") == 4
        text = browser.evaluate("document.body.innerText")
        assert "rejected" in text and "not recorded" not in text  # the manifests keep the loss curve now
        shot = Path(os.environ.get("NIGHTSHIFT_TEST_ARTIFACTS", tmp_path)) / "report.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        width, height = png_size(browser.screenshot(shot))
        assert width == 1280 and height > 1500 and shot.stat().st_size > 50_000
        assert browser.errors() == []
    finally:
        browser.close()

