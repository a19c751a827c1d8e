"""Notifications of a night's events to the webhook targets that subscribe to them.

`promoted` travels with the announcement of the new version (jobs.hotswap.notify_all); the others
(`rejected`, `failed`, `skipped`, `backlog_growing`) are sent by the supervisor when a night closes,
since a failed night may have no child left to report. Same transport, retries, bearer token and
HMAC signature as the announcement (jobs.hotswap.webhook). The body always has `event` and `text`
(one sentence for a human); `payload = "slack"` sends `{"text"}` alone.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import structlog

from jobs.contract import HotswapOutcome, RunSummary
from jobs.hotswap import webhook
from jobs.hotswap.config import HotswapConfig, NightEvent, WebhookTarget
from jobs.hotswap.core import Clock, Sleep

_log = structlog.get_logger("nightshift.notify")
BACKLOG_NIGHTS = 3  # "growing": it grew this many nights in a row (as the NightshiftBacklogGrowing alert)


def subscribers(cfg: HotswapConfig, event: NightEvent) -> list[WebhookTarget]:
    return [t for t in cfg.targets if isinstance(t, WebhookTarget) and event in t.events]


def backlog_growing(backlogs: Sequence[int]) -> bool:
    """Backlogs after the last nights, oldest first: did the last BACKLOG_NIGHTS each grow it?"""
    last = list(backlogs)[-(BACKLOG_NIGHTS + 1):]
    return len(last) == BACKLOG_NIGHTS + 1 and all(b > a for a, b in itertools.pairwise(last))


def _why_rejected(s: RunSummary) -> str:
    if s.gate is None:
        return "the gate did not pass"
    if s.gate.held_back:
        return s.gate.held_back
    failed = [f"{c.name} {c.change_pct:+.1f} % ({c.rule})" if c.change_pct is not None else f"{c.name} ({c.rule})"
              for c in s.gate.checks if not c.passed]
    return "gate failed: " + ("; ".join(failed) or "no rule passed")


def describe(event: NightEvent, s: RunSummary, backlogs: Sequence[int] = ()) -> tuple[str, dict[str, Any]]:
    """(text, fields) of one event of the night `s`."""
    fields: dict[str, Any] = {"night": s.night, "run_id": s.run_id, "outcome": s.outcome.value,
                              "version": s.version, "name": s.version_name, "error": s.error,
                              "trained_samples": s.trained_samples, "backlog_samples": s.backlog_samples}
    night = f"night {s.night}" if s.night else "a night"
    if s.adapter:  # [[adapters]]: whose night this is
        fields["adapter"], night = s.adapter, f"{night} of adapter {s.adapter}"
    if event == "rejected":
        fields["gate"] = s.gate.model_dump(mode="json") if s.gate else None
        text = f"nightshift: {s.version_name or 'the candidate'} of {night} was NOT promoted: {_why_rejected(s)}"
    elif event == "failed":
        text = f"nightshift: {night} FAILED: {s.error or 'no reason recorded'}"
    elif event == "skipped":
        text = f"nightshift: {night} skipped: {s.error or 'nothing to do'}"
    elif event == "backlog_growing":
        fields["backlogs"] = list(backlogs)
        text = (f"nightshift: the backlog grew {BACKLOG_NIGHTS} nights in a row "
                f"({' -> '.join(f'{b:,}' for b in backlogs)} samples): more data arrives than a night can train")
    else:
        text = f"nightshift: {s.version_name} of {night} is now in service"
    return text, fields


def send_event(cfg: HotswapConfig, event: NightEvent, text: str, fields: dict[str, Any], *,
               sleep: Sleep = time.sleep, clock: Clock = time.monotonic, log: Any = _log) -> list[HotswapOutcome]:
    """POST the event to every webhook subscribed to it; one outcome per target (never raises)."""
    outcomes = []
    for t in subscribers(cfg, event):
        payload = {"text": text} if t.payload == "slack" else {"event": event, "text": text, **fields}
        o = webhook.post(t, webhook.body_bytes(payload), sleep=sleep, clock=clock, log=log)
        if o.ok:
            log.info("notify.ok", target=t.name, notification=event, attempts=o.attempts)
        else:
            log.error("notify.failed", target=t.name, notification=event, attempts=o.attempts, error=o.error)
        outcomes.append(o)
    return outcomes
