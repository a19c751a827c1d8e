"""Notifications: webhook targets subscribe to events (promoted, rejected, failed, skipped,
backlog_growing); each POST is signed as the announcement is; `payload = "slack"` sends {"text"}."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from daemon.notify import Notifier, recent_backlogs
from jobs.contract import GateCheck, GateResult, Outcome, RunSummary
from jobs.hotswap import HotswapConfig, notify_all, verify_signature
from jobs.hotswap.events import backlog_growing, describe, send_event
from jobs.store.ledger import Ledger
from tests.fixtures.lora_servers import Fake, start
from tests.hotswap.test_hotswap import Sleeps, adapter

REJECTED = RunSummary(run_id="2026-11-21-abc", night="2026-11-21", outcome=Outcome.rejected, version=7,
                      version_name="tiny-v0007", trained_samples=40, backlog_samples=3,
                      gate=GateResult(passed=False, checks=[GateCheck(
                          name="regression.loss", before=1.0, after=1.031, change=0.031, change_pct=3.1,
                          rule="worse by <= 2%", passed=False)]))


def hooks(srv: Fake, slack: Fake, secret_file: Path) -> HotswapConfig:
    return HotswapConfig.model_validate({"targets": [
        {"kind": "webhook", "name": "ops", "url": srv.url + "/ops", "hmac_secret_file": str(secret_file),
         "events": ["rejected", "failed", "backlog_growing"]},
        {"kind": "webhook", "name": "slack", "url": slack.url + "/services/T/B/X", "payload": "slack",
         "events": ["promoted", "rejected"]},
        {"kind": "webhook", "name": "deployer", "url": srv.url + "/deploy"},  # default: promoted only
    ]})


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    f = tmp_path / "hmac"
    f.write_text("s3cret\n")
    f.chmod(0o600)
    return f


def test_each_target_gets_the_events_it_subscribes_to_signed(tmp_path, servers, secret):
    srv, slack = start(servers, "webhook", secret="s3cret"), start(servers, "webhook")
    cfg = hooks(srv, slack, secret)
    text, fields = describe("rejected", REJECTED)
    assert text == ("nightshift: tiny-v0007 of night 2026-11-21 was NOT promoted: gate failed: "
                    "regression.loss +3.1 % (worse by <= 2%)")
    outcomes = send_event(cfg, "rejected", text, fields, sleep=Sleeps())
    assert [(o.target, o.ok) for o in outcomes] == [("ops", True), ("slack", True)]
    [ops] = srv.posts("/ops")
    body = json.loads(ops["raw"])
    assert body["event"] == "rejected" and body["text"] == text and body["run_id"] == "2026-11-21-abc"
    assert body["gate"]["checks"][0]["name"] == "regression.loss" and body["version"] == 7
    assert verify_signature("s3cret", ops["raw"], ops["headers"], now=time.time())
    assert json.loads(slack.posts("/services/T/B/X")[0]["raw"]) == {"text": text}  # Slack's incoming-webhook shape
    assert srv.posts("/deploy") == []

    send_event(cfg, "skipped", *describe("skipped", REJECTED), sleep=Sleeps())  # nobody subscribed
    assert len(srv.requests) == 1 and len(slack.requests) == 1

    # a promotion: the announcement reaches the subscribers of "promoted" only
    notify_all(cfg, adapter(tmp_path, 8), sleep=Sleeps())
    assert [json.loads(r["raw"])["event"] for r in srv.posts("/deploy")] == ["promoted"]
    assert srv.posts("/ops") == [ops]
    assert json.loads(slack.requests[-1]["raw"]) == {"text": "nightshift: tiny-v0008 is now in service"}


def test_unknown_events_are_refused():
    with pytest.raises(ValidationError, match="events"):
        HotswapConfig.model_validate({"targets": [{"kind": "webhook", "name": "w", "url": "http://h/x",
                                                   "events": ["promotion"]}]})


def test_backlog_growing_means_three_nights_in_a_row():
    assert backlog_growing([1, 2, 3, 4]) and backlog_growing([9, 1, 2, 3, 4])
    assert not backlog_growing([2, 3, 4]) and not backlog_growing([1, 2, 2, 4]) and not backlog_growing([4, 3, 2, 1])


def test_the_supervisor_raises_the_night_events(tmp_path, servers, secret):
    srv, slack = start(servers, "webhook", secret="s3cret"), start(servers, "webhook")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    for i, backlog in enumerate([5, 10, 20, 40]):
        run = f"2026-11-{18 + i}-x"
        ledger.start_run(run, f"2026-11-{18 + i}", 0)
        ledger.finish_run(run, "succeeded", summary=RunSummary(run_id=run, outcome=Outcome.succeeded,
                                                               backlog_samples=backlog))
    assert recent_backlogs(ledger) == [5, 10, 20, 40]
    notifier = Notifier(hooks(srv, slack, secret), ledger)
    notifier.night_closed(RunSummary(run_id="r", night="2026-11-21", outcome=Outcome.failed, error="CUDA error"))
    events = [json.loads(r["raw"]) for r in srv.posts("/ops")]
    assert [e["event"] for e in events] == ["failed", "backlog_growing"]
    assert events[0]["text"] == "nightshift: night 2026-11-21 FAILED: CUDA error"
    assert events[1]["backlogs"] == [5, 10, 20, 40] and "5 -> 10 -> 20 -> 40 samples" in events[1]["text"]
    assert slack.requests == []  # subscribed to neither
    ledger.close()
