"""The supervisor's notifications when a night closes: rejected, failed, skipped, backlog_growing.

Which events a night raises is decided here, from its summary and the ledger; the sending is
jobs.hotswap.events (webhooks subscribed to the event, signed). The service sends from a
background thread, so a slow receiver never delays the watchdog or the next window; `once`
sends before it exits.
"""

from __future__ import annotations

import contextvars
import json
import threading

import structlog

from jobs.contract import Outcome, RunSummary
from jobs.hotswap import HotswapConfig
from jobs.hotswap.events import BACKLOG_NIGHTS, backlog_growing, describe, send_event, subscribers
from jobs.store.ledger import Ledger

log = structlog.get_logger("nightshift.notify")


def recent_backlogs(ledger: Ledger, nights: int = BACKLOG_NIGHTS + 1) -> list[int]:
    """The backlog after each of the last closed runs that recorded one, oldest first."""
    rows = ledger.db.execute("SELECT summary FROM runs WHERE ended_at IS NOT NULL AND summary IS NOT NULL "
                             "ORDER BY ended_at DESC LIMIT ?", (4 * nights,)).fetchall()
    out = []
    for r in rows:
        backlog = json.loads(r[0]).get("backlog_samples")
        if backlog is not None:
            out.append(int(backlog))
        if len(out) == nights:
            break
    return out[::-1]


class Notifier:
    def __init__(self, cfg: HotswapConfig, ledger: Ledger, *, background: bool = False) -> None:
        self.cfg, self.ledger, self.background = cfg, ledger, background
        self._threads: list[threading.Thread] = []

    def events_of(self, s: RunSummary) -> list[tuple[str, str, dict]]:
        """(event, text, fields) for the night that just closed."""
        out = []
        for each in s.adapters or [s]:  # [[adapters]]: each adapter's own rejection or failure
            if each.outcome in (Outcome.rejected, Outcome.failed, Outcome.skipped):
                out.append((each.outcome.value, *describe(each.outcome.value, each)))
        backlogs = recent_backlogs(self.ledger)
        if backlog_growing(backlogs):
            out.append(("backlog_growing", *describe("backlog_growing", s, backlogs)))
        return out

    def night_closed(self, s: RunSummary) -> None:
        if not any(t.kind == "webhook" for t in self.cfg.targets):
            return
        for event, text, fields in self.events_of(s):
            if not subscribers(self.cfg, event):  # type: ignore[arg-type]
                continue
            if self.background:
                t = threading.Thread(target=contextvars.copy_context().run,
                                     args=(send_event, self.cfg, event, text, fields), daemon=True)
                t.start()
                self._threads.append(t)
            else:
                send_event(self.cfg, event, text, fields)  # type: ignore[arg-type]

    def join(self, timeout: float) -> None:
        """Give notifications under way a little time to go out (at shutdown)."""
        for t in self._threads:
            t.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]
