"""`nightshift status` shows what the operator must know of learning: the regression set, the gate's
reference, and the samples rejected nights gave back or set aside (with why)."""

from __future__ import annotations

from pathlib import Path

from daemon import status
from daemon.settings import load_settings
from jobs.store import learning
from jobs.store.ledger import Ledger


def test_status_shows_set_aside_samples_with_their_reason_the_regression_set_and_the_reference(tmp_path: Path):
    s = load_settings(state_dir=tmp_path / "state")
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    with led.tx() as c:
        for i in range(10):
            led.add_sample(c, hash=f"{i:064x}", source="inbox", file_id=1, line=i,
                           record_json='{"text": "x"}', n_tokens=3)
        for version, reason in ((2, "regression.exact_match 1 -> 0.2"), (3, "again")):
            learning.return_rejected(led, c, [1, 2, 3], version=version, reason=reason, mode="pending",
                                     set_aside_after=2)
        learning.return_rejected(led, c, [4], version=3, reason="again", mode="pending", set_aside_after=2)
        led.mark_heldout(c, [8, 9, 10], version=1)
        learning.add_regression_slices(led, c, led.samples_by_id([8, 9, 10]), night="n1", version=1, per_slice=32)
        learning.set_reference(led, c, 1, run_id="r", detail={})
    led.close()
    info = status.collect(s)
    assert info["learning"] == {"set_aside": 3, "set_aside_reasons": {"v2: regression.exact_match 1 -> 0.2": 3},
                                "ever_rejected": 4, "reference_version": 1, "regression_samples": 3,
                                "regression_slices": 1}
    assert info["samples"] == {"pending": 4, "set_aside": 3, "heldout": 3}
    text = status.render(info)
    assert "3 samples from 1 night/source slices" in text and "v0001 (best promoted so far)" in text
    assert "4 samples were in one; 3 set aside" in text and "3: v2: regression.exact_match 1 -> 0.2" in text


def test_the_nights_summary_reads_exact_match_per_model_and_what_a_rejected_night_gave_back():
    from daemon.report import summary_table
    from tests.fixtures.metrics_samples import summary

    text = summary_table(summary(not_evaluated={"heldout": "3 heldout samples < min_eval_samples 8"}))
    assert "90.0% -> 92.5% (reference 90.0%, base 0.0%)" in text
    assert "not evaluated: 3 heldout samples < min_eval_samples 8" in text
    assert "12 put back, 3 set aside" in text


def test_a_run_no_night_holds_is_shown_stopped_with_what_comes_of_it(tmp_path: Path):
    """After Ctrl-C or SIGTERM, `status` listed the open run as "running" though nothing ran."""
    import time

    from jobs.store.locking import night_lock

    s = load_settings(state_dir=tmp_path / "state")
    led = Ledger(tmp_path / "state" / "ledger.sqlite")
    led.start_run("manual-2026-11-28-abc123", "manual-2026-11-28", deadline=time.time() + 3600)
    led.close()
    (run,) = status.collect(s)["runs"]
    assert run["status"] == "stopped" and "resumes it from its last checkpoint" in run["error"]
    assert "stopped" in status.render(status.collect(s))
    with night_lock(tmp_path / "state"):  # a night holds the state directory: its run is running
        (run,) = status.collect(s)["runs"]
        assert (run["status"], run["error"]) == ("running", None)
