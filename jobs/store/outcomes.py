"""What the supervisor (daemon or `once`) records about a night beyond the child's own writes."""

from __future__ import annotations

from jobs.store.cleanup import close_run
from jobs.store.ledger import Ledger


class NightOutcomes:
    """What the supervisor (daemon or `once`) records about a night beyond the child's own writes."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def failures(self, night: str) -> int:
        q = "SELECT COUNT(*) FROM events WHERE kind='attempt_failed' AND json_extract(detail, '$.night')=?"
        return int(self.ledger.db.execute(q, (night,)).fetchone()[0])

    def attempt_failed(self, night: str, error: str, tail: list[str]) -> None:
        """A child that died without reporting (signal, segfault, CUDA abort): keep why."""
        run = self.ledger.open_run(night)
        self.ledger.add_event("attempt_failed", run_id=run["id"] if run else None,
                              detail={"night": night, "error": error, "tail": tail[-20:]})

    def close(self, night: str, status: str, error: str, deadline: float | None = None) -> str:
        """Close tonight's open run (or record one) as failed/skipped, so the night counts as done.

        A run whose version was already recorded promoted (killed while announcing it: a server that
        hung, the window's end) is closed as succeeded, its error saying the hot-swap was cut: the
        version is in service whatever the servers heard, and the next start re-sends it."""
        run = self.ledger.open_run(night)
        if run is None:
            run_id = f"{night}-{status}-{int(self.ledger.clock())}"
            self.ledger.start_run(run_id, night, deadline or self.ledger.clock())
        else:
            run_id = run["id"]
        promoted = self.ledger.db.execute("SELECT name FROM versions WHERE run_id=? AND status='promoted'",
                                          (run_id,)).fetchone()
        if promoted is not None and status == "failed":
            status, error = "succeeded", f"{promoted['name']} promoted; its hot-swap was cut: {error}"
        close_run(self.ledger, run_id, status, error=error)  # also drops its checkpoints, frees its number
        return run_id
