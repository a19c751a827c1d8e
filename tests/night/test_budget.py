import json

import pytest

from jobs.learning.plan import PlanConfig, estimate, is_heldout, make_plan
from jobs.store.ledger import SampleRow


def rows(n, tokens=100):
    return [SampleRow(i, f"{i * 2654435761 % 2**32:08x}" + "0" * 56, {}, tokens, "s") for i in range(1, n + 1)]


def hist(tps, overhead, origin="run"):
    return {"tokens_per_second": tps, "overhead_seconds": overhead, "origin": origin}


def test_prior_when_nothing_measured_and_says_so():
    cfg = PlanConfig(prior_tokens_per_second=100, prior_overhead_seconds=10, heldout_share=0, safety_factor=1)
    p = make_plan(rows(50), now=0, deadline=30, history=[], cfg=cfg, epochs=1, key="k")
    assert not p.measured and "prior" in p.basis
    # (30 s - 10 s overhead) x 100 tok/s = 2000 tokens = 20 samples of 100 tokens
    assert len(p.train_ids) == 20 and p.deferred_samples == 30 and p.deferred_tokens == 3000
    assert p.predicted_train_seconds == 20.0


def test_measured_history_median_and_epochs():
    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    history = [hist(205, 100), hist(195, 100), hist(200, 300)]  # within 10 %: median 200 tok/s, 100 s overhead
    tps, overhead, basis, measured = estimate(history, cfg)
    assert (tps, overhead, measured) == (200, 100, True) and "median of 3" in basis
    p = make_plan(rows(100), now=0, deadline=600, history=history, cfg=cfg, epochs=2, key="k")
    # (600 - 100) x 200 / 2 epochs = 50,000 tokens: all 100 samples of 100 tokens fit
    assert len(p.train_ids) == 100 and p.predicted_train_seconds == 100.0
    p = make_plan(rows(100, tokens=1000), now=0, deadline=600, history=history, cfg=cfg, epochs=2, key="k")
    assert len(p.train_ids) == 50 and p.deferred_samples == 50


def test_oldest_first_and_heldout_is_deterministic():
    cfg = PlanConfig(heldout_share=0.2, safety_factor=1, prior_overhead_seconds=0)
    a = make_plan(rows(200), now=0, deadline=1e6, history=[], cfg=cfg, epochs=1, key="k")
    b = make_plan(rows(200), now=0, deadline=1e6, history=[], cfg=cfg, epochs=1, key="k")
    assert a.heldout_ids == b.heldout_ids and 10 < len(a.heldout_ids) < 70
    assert a.train_ids == sorted(a.train_ids) and not set(a.train_ids) & set(a.heldout_ids)


def test_no_time_left_defers_everything():
    cfg = PlanConfig(prior_overhead_seconds=600)
    p = make_plan(rows(10), now=0, deadline=300, history=[], cfg=cfg, epochs=1, key="k")
    assert p.train_ids == [] and p.deferred_samples == 10 and p.available_seconds == 0


def test_heldout_share_zero():
    assert not is_heldout("ffffffff", 0)


def test_throughputs_that_vary_plan_with_a_low_quantile_and_say_so():
    cfg = PlanConfig(heldout_share=0, safety_factor=1, history_runs=5)
    history = [hist(1000, 0), hist(400, 0), hist(900, 0), hist(950, 0), hist(1000, 0)]  # median 950, spread 63 %
    tps, _, basis, measured = estimate(history, cfg)
    assert measured and tps == 400 + (900 - 400) * 0.8  # the 20 % quantile of 400, 900, 950, 1000, 1000
    assert "vary by 63%" in basis and "20% quantile 800 tok/s (median 950)" in basis
    assert estimate(history, PlanConfig(throughput_quantile=0.5, history_runs=5))[0] == 950


def test_heldout_comes_from_the_whole_backlog_so_every_night_has_some():
    """A backlog: each night trains its share and holds out in proportion, from all pending samples
    (deferred included); the held-out candidates it does not take wait for the following nights."""
    cfg = PlanConfig(heldout_share=0.1, safety_factor=1, prior_tokens_per_second=100, prior_overhead_seconds=0)
    pending = rows(1000)
    candidates = [s.id for s in pending if is_heldout(s.hash, 0.1)]
    nights = []
    while pending:
        p = make_plan(pending, now=0, deadline=50, history=[], cfg=cfg, epochs=1, key="k", min_heldout=3)
        if not p.train_ids:
            break
        nights.append(p)
        done = set(p.train_ids) | set(p.heldout_ids)
        pending = [s for s in pending if s.id not in done]
    assert len(nights) >= 10 and all(len(p.train_ids) == 50 for p in nights[:-1])
    # each night holds out its share of the candidates (~50 trained of ~900 trainable: ~6 of 100); the last the rest
    assert all(4 <= len(p.heldout_ids) <= 7 for p in nights), [len(p.heldout_ids) for p in nights]
    taken = [i for p in nights for i in p.heldout_ids]
    assert sorted(taken) == sorted(candidates) and len(set(taken)) == len(taken)
    small = make_plan(rows(1000), now=0, deadline=5, history=[], cfg=cfg, epochs=1, key="k", min_heldout=3)
    assert len(small.train_ids) == 5 and len(small.heldout_ids) == 3  # at least min_heldout


def test_the_runs_warm_up_is_added_to_the_predicted_training_time():
    """A run records its steady rate and its warm-up steps (the compile) apart: the plan predicts both."""
    import json

    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    history = [{**hist(200, 100), "detail": json.dumps({"warmup_seconds": w})} for w in (4.0, 6.0, 5.0)]
    history.append({**hist(200, 100, origin="calibrate"), "detail": json.dumps({"overhead_seconds": 100})})
    p = make_plan(rows(100), now=0, deadline=600, history=history, cfg=cfg, epochs=1, key="k")
    assert p.predicted_train_seconds == 10_000 / 200 + 5.0  # the median warm-up of the runs that had one
    nothing = make_plan(rows(100), now=0, deadline=100, history=history, cfg=cfg, epochs=1, key="k")
    assert nothing.train_ids == [] and nothing.predicted_train_seconds == 0.0


def timed(tps, seconds, origin="run", overhead=40.0):
    return {"tokens_per_second": tps, "seconds": seconds, "tokens": tps * seconds, "overhead_seconds": overhead,
            "origin": origin}


def test_a_few_steps_after_a_restart_do_not_drag_the_next_plan_down():
    """The H100 acceptance run (2026-11-23): calibrate 67,478 tok/s over 6 s, night 1 72,756 over ~21 s, the killed
    night 2's restart 51,468 over ~4 s. Night 3 planned with the 20 % quantile of the three, 57,872, and trained its
    2,883,258 tokens in 40.2 s against 51.8 s predicted (-22 %). The restart's rate is left out and said so, and
    calibrate's is too: a night has measured since."""
    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    history = [timed(51_468, 3.8), timed(72_756, 20.6), timed(67_478, 6.0, origin="calibrate")]
    tps, _, basis, measured = estimate(history, cfg)
    assert measured and tps == 72_756
    assert "median of 1" in basis and "left out 1 that timed 3.8 s" in basis and "calibrate left out" in basis
    assert abs(2_883_258 / tps - 40.2) / 40.2 < 0.03  # the night's own training seconds, warm-up aside


def test_a_long_slow_night_is_kept_and_the_plan_stays_careful():
    """A night the card was slower for (a busy inference server) timed minutes: it is a measurement, not noise."""
    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    history = [timed(40_000, 90.0), timed(72_000, 1200.0), timed(71_000, 1100.0)]
    tps, _, basis, _ = estimate(history, cfg)
    assert tps < 60_000 and "quantile" in basis and "left out" not in basis


def test_short_measurements_alone_are_all_used():
    history = [timed(1000, 1.0), timed(960, 1.2), timed(950, 0.4)]  # a CPU's nights: a second or so each
    tps, _, basis, _ = estimate(history, PlanConfig())
    assert tps == 960 and "median of 3" in basis and "left out" not in basis


def test_checkpoint_saves_are_planned_per_save_not_read_into_the_rate():
    """The H200 acceptance run (2026-11-25): the killed night saved every second, so its run recorded
    60,087 tok/s against 83,201 and the next night planned 23 % long. Runs record their saves apart;
    the plan adds one save per `checkpoint_every_seconds` of training and fits less data when saves are many."""
    import json

    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    history = [{**hist(200, 100), "detail": json.dumps({"checkpoints": n, "checkpoint_seconds": 0.5 * n})}
               for n in (10, 4, 0)]
    rare = make_plan(rows(100), now=0, deadline=600, history=history, cfg=cfg, epochs=1, key="k",
                     checkpoint_every_seconds=600)
    assert rare.predicted_train_seconds == 50.0  # no save falls inside 50 s of training
    often = make_plan(rows(100), now=0, deadline=600, history=history, cfg=cfg, epochs=1, key="k",
                      checkpoint_every_seconds=5)
    assert often.predicted_train_seconds == 50.0 + 10 * 0.5  # ten saves of the runs' median 0.5 s
    unknown = make_plan(rows(100), now=0, deadline=600, history=history[2:], cfg=cfg, epochs=1, key="k",
                        checkpoint_every_seconds=5)
    assert unknown.predicted_train_seconds == 50.0  # no run has saved yet: nothing to add
    tight = make_plan(rows(100), now=0, deadline=150, history=history, cfg=cfg, epochs=1, key="k",
                      checkpoint_every_seconds=1)
    assert len(tight.train_ids) == 66  # 50 s at 200 tok/s, a third of it saving: 6,666 tokens, 66 samples


def test_a_runs_checkpoint_saves_are_left_out_of_the_rate_it_records(monkeypatch):
    """close_run records the steady rate: warm-up, the settling steps' excess and periodic saves out, all in
    the run's detail."""
    import jobs.night.publish as publish

    recorded = {}

    class Ledger:
        def record_throughput(self, **kw):
            recorded.update(kw)

    class Ctx:
        summary = type("S", (), {"phase_seconds": {}})()
        ledger, run_id = Ledger(), "r"
        measures = ledger  # the ledger throughput goes to (the shared one, with [[adapters]])

        def finish(self, outcome):
            recorded["outcome"] = outcome

    from jobs.training.loop import TrainResult

    result = TrainResult(trained_ids=[], tokens=12_000, seconds=20.0, steps=12, mean_loss=1.0, stopped=None,
                         warmup_tokens=2_000, warmup_seconds=4.0, checkpoints=8, checkpoint_seconds=6.0,
                         ramp_seconds=1.5)
    plan = type("Q", (), {"backend": "hf", "device": "cpu", "train_ids": [1, 2, 3], "replay_ids": [4],
                          "train_tokens": 1_000})()
    planned = type("P", (), {"key": "k", "plan": plan})()
    published = type("Pub", (), {"promoted": True})()
    monkeypatch.setattr(publish, "remove_checkpoints", lambda ctx: None)
    publish.close_run(Ctx(), planned, result, published)
    assert recorded["tokens"] == 10_000 and recorded["seconds"] == 8.5  # 20 s - 4 warm-up - 6 saving - 1.5 ramp
    assert recorded["detail"]["checkpoints"] == 8 and recorded["detail"]["checkpoint_seconds"] == 6.0
    # the settling steps' excess is planned again with the warm-up (expected_warmup), and said apart
    assert recorded["detail"]["warmup_seconds"] == 5.5 and recorded["detail"]["ramp_seconds"] == 1.5
    assert recorded["overhead_seconds"] == 5.5
    assert recorded["detail"]["mean_sample_tokens"] == 250.0  # the length the rate was measured at


def test_nights_measured_since_calibrate_replace_it_and_a_newer_calibrate_counts_again():
    """The H200 (2026-11-26): calibrate 14,768 tok/s (random tokens), the 5-minute night after it 16,556; the
    two vary by 11 %, so the next plan would have taken their low quantile. The night alone is the basis."""
    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    night, cal = timed(16_556, 290.0), timed(14_768, 10.0, origin="calibrate")
    tps, _, basis, _ = estimate([night, cal], cfg)
    assert tps == 16_556 and "calibrate left out: nights measured since" in basis
    tps, _, basis, _ = estimate([{**cal, "origin": "calibrate scaled x0.95"}, night], cfg)  # re-calibrated since
    assert tps < 16_556 and "calibrate left out" not in basis
    assert estimate([cal], cfg)[0] == 14_768


def test_a_rate_is_taken_at_tonights_sample_length_on_calibrates_line():
    """calibrate timed 117-token and 861-token samples; a night of short samples plans with the short
    profile's rate (calibrate's row holds the slower one), a night's own rate moves along the same line."""
    from jobs.learning.plan import rate_at_length

    curve = {117.0: 15_288.0, 861.0: 14_768.0}
    assert rate_at_length(curve, 85) == 15_288 and rate_at_length(curve, 5_000) == 14_768
    mid = rate_at_length(curve, (117 * 861) ** 0.5)  # halfway on a log scale
    assert mid == pytest.approx((15_288 + 14_768) / 2)
    cfg = PlanConfig(heldout_share=0, safety_factor=1)
    cal = timed(14_768, 10.0, origin="calibrate")
    tps, _, basis, _ = estimate([cal], cfg, curve=curve, mean_tokens=85.0)
    assert tps == pytest.approx(15_288) and "at 85 tokens a sample" in basis
    night = {**timed(16_000, 300.0), "detail": json.dumps({"mean_sample_tokens": 861.0})}
    assert estimate([night], cfg, curve=curve, mean_tokens=117.0)[0] == pytest.approx(16_000 * 15_288 / 14_768)
    old = timed(16_000, 300.0)  # a row from before nights said their length: as it is
    assert estimate([old], cfg, curve=curve, mean_tokens=117.0)[0] == 16_000
    p = make_plan(rows(100, tokens=85), now=0, deadline=1e6, history=[cal], cfg=cfg, epochs=1, key="k", curve=curve)
    assert p.tokens_per_second == pytest.approx(15_288)
    # a card where the short profile is the slower one: calibrate's row holds that rate, long samples go faster
    short_slow = {117.0: 70_000.0, 861.0: 80_000.0}
    cal = timed(70_000, 10.0, origin="calibrate")
    assert estimate([cal], cfg, curve=short_slow, mean_tokens=861.0)[0] == pytest.approx(80_000)
    assert estimate([cal], cfg, curve=short_slow, mean_tokens=50.0)[0] == pytest.approx(70_000)
