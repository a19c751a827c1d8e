"""Replay in the plan: a share of the night's training tokens from earlier nights' samples,
accounted in the capacity, chosen deterministically, stored with role 'replay' and never re-marked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from jobs.contract import Plan
from jobs.learning.plan import PlanConfig, make_plan
from jobs.store.ledger import Ledger, SampleRow


def rows(ids: range, tokens: int) -> list[SampleRow]:
    return [SampleRow(i, f"{i * 2654435761 % 2**32:08x}" + "0" * 56, {}, tokens, "s") for i in ids]


NEW = rows(range(1, 201), 100)  # 200 pending samples of 100 tokens
POOL = rows(range(1001, 1501), 50)  # 500 earlier samples of 50 tokens


def plan(pending=NEW, pool=POOL, *, share=0.2, deadline=100.0, epochs=1, seed="run-a"):
    # 100 tok/s, no overhead, safety 1: capacity = deadline x 100 / epochs tokens
    cfg = PlanConfig(
        prior_tokens_per_second=100, prior_overhead_seconds=0, safety_factor=1, heldout_share=0, replay_share=share
    )
    return make_plan(
        list(pending),
        now=0,
        deadline=deadline,
        history=[],
        cfg=cfg,
        epochs=epochs,
        key="k",
        replay_pool=list(pool),
        seed=seed,
    )


def test_default_share_is_documented_and_bounded():
    assert PlanConfig().replay_share == 0.5  # measured: RESULTS.md: 2026-11-23, CPU chain of nights
    with pytest.raises(ValueError):
        PlanConfig(replay_share=1.0)


def test_a_full_night_gives_the_share_of_its_capacity_to_replay():
    p = plan()  # capacity 10,000 tokens: 8,000 new + 2,000 replay
    assert len(p.train_ids) == 80 and p.deferred_samples == 120
    assert len(p.replay_ids) == 40 and p.replay_tokens == 2000
    assert p.train_tokens == 10_000 and p.replay_tokens / p.train_tokens == pytest.approx(0.2)
    assert p.predicted_train_seconds == 100.0 <= p.available_seconds
    assert set(p.replay_ids) <= {s.id for s in POOL} and not set(p.replay_ids) & set(p.train_ids)


def test_epochs_divide_the_capacity_for_replay_too():
    p = plan(epochs=2)  # 5,000 tokens per epoch
    assert p.train_tokens == 5000 and p.replay_tokens == 1000 and p.predicted_train_seconds == 100.0


def test_a_small_night_gets_a_small_replay():
    p = plan(NEW[:10], share=0.1, deadline=1e6)  # 1,000 new tokens: replay <= 111 tokens
    assert len(p.train_ids) == 10 and p.replay_tokens == 100 and len(p.replay_ids) == 2
    assert p.replay_tokens / p.train_tokens <= 0.1


def test_new_samples_take_what_a_small_pool_cannot_fill():
    """The H200 (2026-11-26): night 2 after a 5-minute first night had a pool of 4.4 M tokens against a replay
    share of 9.7 M; the new samples were held to half the capacity all the same, 17,086 of them were deferred
    and the night ended 7.5 minutes before its window. The new samples now take what the pool cannot fill."""
    small = POOL[:20]  # 1,000 tokens against a share of 0.5 x 10,000
    p = plan(share=0.5, pool=small)
    assert p.replay_tokens == 1000 and len(p.replay_ids) == 20
    assert len(p.train_ids) == 90 and p.train_tokens == 10_000  # 9,000 new: the whole capacity is used
    assert plan(share=0.5).replay_tokens == 5000 and len(plan(share=0.5).train_ids) == 50  # a pool that can fill


def test_no_pool_no_share_or_nothing_new_means_no_replay():
    assert plan(pool=[]).replay_ids == [] and len(plan(pool=[]).train_ids) == 100  # the whole capacity is new
    assert plan(share=0).replay_ids == []
    empty = plan(pending=[])
    assert empty.train_ids == [] and empty.replay_ids == [] and empty.train_tokens == 0  # no replay-only night


def test_selection_is_deterministic_per_run_and_independent_of_pool_order():
    a, b = plan(seed="run-a"), plan(seed="run-a")
    shuffled = list(POOL)
    random.Random(1).shuffle(shuffled)
    assert a.replay_ids == b.replay_ids == plan(pool=shuffled, seed="run-a").replay_ids
    assert a.replay_ids != plan(seed="run-b").replay_ids  # another night replays other samples
    assert a.replay_ids == sorted(a.replay_ids)


def test_roles_spread_replay_among_new_samples_then_heldout():
    p = plan()
    p.heldout_ids = [999]
    roles = p.roles()
    assert [sid for sid, r in roles if r == "train"] == p.train_ids  # new samples keep the plan order
    assert [sid for sid, r in roles if r == "replay"] == p.replay_ids
    assert roles[-1] == (999, "heldout") and len(roles) == 80 + 40 + 1
    first_half = [r for _, r in roles[:60]]
    assert first_half.count("replay") == 20  # 2 new : 1 replay all along, not bunched at one end
    assert plan(pool=[]).roles() == [(i, "train") for i in range(1, 101)]


def test_ledger_pool_roles_and_replayed_samples_stay_in_their_version(tmp_path: Path):
    led = Ledger(tmp_path / "ledger.sqlite")
    with led.tx() as c:
        for i in range(6):
            led.add_sample(c, hash=f"{i:064x}", source="s", file_id=1, line=i,
                           record_json=f'{{"text": "t{i}"}}', n_tokens=10)
        led.mark_trained(c, [1, 2, 3], version=1)
    pool = led.replay_pool()
    assert [s.id for s in pool] == [1, 2, 3] and all(s.record == {} and s.n_tokens == 10 for s in pool)
    led.start_run("r2", "n2", 0)
    roles = [(4, "train"), (1, "replay"), (5, "train"), (6, "heldout")]
    plan = Plan(key="k", train_ids=[4, 5], heldout_ids=[6], replay_ids=[1], train_tokens=30, deferred_samples=0,
                deferred_tokens=0, tokens_per_second=1.0, overhead_seconds=0.0, available_seconds=1.0,
                predicted_train_seconds=30.0, epochs=1, basis="test", measured=False, version=2, parent_version=1)
    led.save_plan("r2", plan, roles, "tiny-v0002")
    assert led.run_samples("r2") == roles
    with led.tx() as c:  # what the night does at publish: new ones only; replay is already 'trained'
        led.mark_trained(c, [4, 5], version=2)
        led.mark_trained(c, [1], version=2)  # even if it were passed, a trained sample is never re-marked
    versions = dict(led.db.execute("SELECT id, version FROM samples WHERE status='trained'").fetchall())
    assert versions == {1: 1, 2: 1, 3: 1, 4: 2, 5: 2}


# ---- stratified by night and source -------------------------------------------------------------
def strata_pool() -> list[SampleRow]:
    """Night 1 trained 400 samples of source a, night 2 50 of a and 50 of b, night 3 4 of a."""
    out, i = [], 5000
    for version, source, n in ((1, "a", 400), (2, "a", 50), (2, "b", 50), (3, "a", 4)):
        for _ in range(n):
            out.append(SampleRow(i, f"{i * 2654435761 % 2**32:08x}" + "0" * 56, {}, 10, source, version))
            i += 1
    return out


def test_replay_gives_every_earlier_night_and_source_its_turn():
    from collections import Counter

    from jobs.learning.replay import choose_replay

    pool = strata_pool()
    picked = choose_replay(pool, 400, "2026-12-01")  # 40 samples of 10 tokens
    by = Counter((s.version, s.source) for s in picked)
    assert sum(by.values()) == 40
    assert by[(3, "a")] == 4  # the small night is replayed whole
    assert by[(1, "a")] == by[(2, "a")] == by[(2, "b")] == 12  # the rest shared evenly, not 400 : 50 : 50
    uniform_share = 400 / len(pool)  # what a uniform draw would have given night 1: 79 %
    assert by[(1, "a")] / 40 < uniform_share / 2


def test_a_minimum_per_stratum_raises_a_small_budget_up_to_its_cap():
    from jobs.learning.replay import choose_replay

    pool = strata_pool()
    assert len(choose_replay(pool, 20, "n")) == 2  # 20 tokens: two samples
    quota = choose_replay(pool, 20, "n", min_per_stratum=2, quota_cap=1000)
    assert len(quota) == 8 and {(s.version, s.source) for s in quota} == {(1, "a"), (2, "a"), (2, "b"), (3, "a")}
    assert len(choose_replay(pool, 20, "n", min_per_stratum=2, quota_cap=50)) == 5  # the cap wins


def test_replay_is_seeded_by_the_night_not_the_run():
    from jobs.learning.replay import choose_replay

    pool = strata_pool()
    shuffled = list(pool)
    random.Random(3).shuffle(shuffled)
    a = [s.id for s in choose_replay(pool, 300, "2026-12-01")]
    assert a == [s.id for s in choose_replay(shuffled, 300, "2026-12-01")]  # same night, any pool order
    assert a != [s.id for s in choose_replay(pool, 300, "2026-12-02")]
    cfg = PlanConfig(prior_tokens_per_second=100, prior_overhead_seconds=0, safety_factor=1, heldout_share=0)
    plans = [make_plan(NEW[:20], now=0, deadline=1e6, history=[], cfg=cfg, epochs=1, key="k", replay_pool=pool,
                       seed="2026-12-01") for _ in range(2)]
    assert plans[0].replay_ids == plans[1].replay_ids and plans[0].replay_tokens == 2000  # share 0.5: as much as new


def test_the_pool_leaves_out_samples_of_rejected_versions(tmp_path: Path):
    from jobs.store import learning

    led = Ledger(tmp_path / "ledger.sqlite")
    with led.tx() as c:
        for i in range(6):
            led.add_sample(c, hash=f"{i:064x}", source="s", file_id=1, line=i,
                           record_json=f'{{"text": "t{i}"}}', n_tokens=10)
        led.mark_trained(c, [1, 2], version=1)
        led.mark_trained(c, [3, 4], version=2)
    for v, status in ((1, "promoted"), (2, "rejected")):
        led.db.execute("INSERT INTO versions (version, name, status, created_at) VALUES (?,?,?,0)",
                       (v, f"t-v{v:04d}", status))
    assert [(s.id, s.version) for s in learning.replay_pool(led)] == [(1, 1), (2, 1)]
