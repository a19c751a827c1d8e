"""[[adapters]]: the config (every problem at once, named as written) and the plan that shares the window."""

import math

import pytest

from daemon.settings import ConfigError, load_settings
from jobs.contract import AdapterShare
from jobs.night.several.share import slice_ends, water_fill
from jobs.store.paths import StatePaths


def _config(tmp_path, adapters: str, sources=("a-in", "b-in"), more: str = "") -> object:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    text = f'state_dir = "{tmp_path / "state"}"\n[model]\npath = "{tmp_path / "model"}"\n{more}\n'
    for s in sources:
        (tmp_path / s).mkdir(exist_ok=True)
        text += f'[[sources]]\nname = "{s}"\ninbox = "{tmp_path / s}"\n'
    path = tmp_path / "nightshift.toml"
    path.write_text(text + adapters)
    return path


def test_a_config_of_adapters_gives_each_its_own_night_and_state(tmp_path):
    s = load_settings(_config(tmp_path, """
[[adapters]]
name = "alpha"
sources = ["a-in"]
weight = 2
train = { lora_rank = 4 }
[[adapters]]
name = "beta"
sources = ["b-in"]
min_share = 0.25
plan = { replay_share = 0.2 }
eval = { max_eval_samples = 64 }
"""))
    cfg = s.night_config()
    assert [a.name for a in cfg.adapters] == ["alpha", "beta"]
    alpha, beta = (a.night for a in cfg.adapters)
    assert alpha.state_dir == StatePaths(s.state_dir).adapter("alpha").root and alpha.shared_dir == s.state_dir
    assert alpha.model.name == "alpha" and [x.name for x in alpha.sources] == ["a-in"]
    assert alpha.train.lora_rank == 4 and beta.train.lora_rank == s.train.lora_rank  # merged over [train]
    assert beta.plan.replay_share == 0.2 and beta.eval.max_eval_samples == 64
    assert alpha.eval.max_eval_samples == s.eval.max_eval_samples
    assert cfg.adapters[0].weight == 2 and cfg.adapters[1].min_share == 0.25
    assert alpha.model.path == beta.model.path == s.model.path  # one base for every adapter


def test_a_config_without_adapters_is_todays(tmp_path):
    s = load_settings(_config(tmp_path, "", sources=("a-in",)))
    cfg = s.night_config()
    assert cfg.adapters == [] and cfg.shared_dir is None and cfg.state_dir == s.state_dir


WRONG = """
[[adapters]]
name = "alpha"
sources = ["a-in", "c-in"]
train = { lora_rnk = 4, epochs = 0 }
hotswap = ["nowhere"]
[[adapters]]
name = "alpha"
sources = ["a-in", "b-inn"]
min_share = 0.6
"""  # two adapters with every problem one can have


def test_every_problem_of_the_adapters_is_named_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_settings(_config(tmp_path, WRONG + """
[[adapters]]
name = "Bad Name"
sources = ["a-in"]
"""))
    text = str(e.value)
    assert "[[adapters]] #3 name" in text  # the pattern, from pydantic, named the way the user writes it
    s = load_settings(_config(tmp_path, "", sources=("a-in",)))  # (the others, checked when the names are right)
    assert s.adapters == []
    with pytest.raises(ConfigError) as e:
        load_settings(_config(tmp_path, WRONG + """
[[adapters]]
name = "gamma"
sources = ["a-in"]
min_share = 0.6
""", sources=("a-in", "b-in", "c-in", "d-in")))
    text = str(e.value)
    for expected in ("[[adapters]] #2 name: 'alpha' is the name of [[adapters]] #1 too",
                     "[[adapters]] #2 sources: 'b-inn' is no [[sources]] name (did you mean 'b-in'?)",
                     "[[adapters]] #1 train.lora_rnk: unknown key (did you mean 'lora_rank'?)",
                     "[[adapters]] #1 train.epochs: Input should be greater than or equal to 1 (got 0)",
                     "[[adapters]] #1 hotswap: 'nowhere' is no [hotswap] target's name",
                     "[[sources]] 'a-in': named by [[adapters]] 'alpha' and 'alpha' and 'gamma'",
                     "[[sources]] 'b-in': named by no [[adapters]]", "[[sources]] 'd-in': named by no [[adapters]]",
                     "[[adapters]] min_share: they add up to 1.2"):
        assert expected in text, (expected, text)
    assert text.count("\n  - ") >= 9  # one line per problem


def _share(name, weight=1.0, min_share=0.0, demand=None):
    return AdapterShare(adapter=name, weight=weight, min_share=min_share, demand_seconds=demand)


def test_shares_follow_weight_capped_by_demand_with_a_floor():
    got = {s.adapter: s.seconds for s in water_fill(100, [_share("a", demand=10), _share("b"), _share("c", 2)])}
    assert got["a"] == pytest.approx(10)  # capped by what it has: the rest goes to the others by weight
    assert got["b"] == pytest.approx(30, rel=1e-6) and got["c"] == pytest.approx(60, rel=1e-6)
    got = {s.adapter: s for s in water_fill(100, [_share("a", 1, min_share=0.3), _share("b", 100)])}
    assert got["a"].seconds == pytest.approx(30, rel=1e-6) and got["a"].share == pytest.approx(0.3, rel=1e-6)
    got = {s.adapter: s.seconds for s in water_fill(100, [_share("a", 1, min_share=0.5, demand=5), _share("b")])}
    assert got["a"] == pytest.approx(5) and got["b"] == pytest.approx(95, rel=1e-6)  # a floor no more than its need
    got = water_fill(100, [_share("a", 1, demand=10), _share("b", 3, demand=30)])  # all fits: spare by weight
    assert [s.seconds for s in got] == pytest.approx([25, 75]) and math.isclose(sum(s.share for s in got), 1)
    assert [s.seconds for s in water_fill(100, [_share("a", demand=0), _share("b", demand=0)])] == [50, 50]


def test_unused_time_passes_to_the_next_adapter():
    shares = water_fill(90, [_share("a"), _share("b"), _share("c")])
    assert slice_ends(1000, 1090, shares) == pytest.approx([1030, 1060, 1090])


def test_the_overheads_come_off_the_window_before_the_training_time_is_shared():
    a = AdapterShare(adapter="a", weight=1, min_share=0, demand_seconds=None, overhead_seconds=60)
    b = AdapterShare(adapter="b", weight=1, min_share=0, demand_seconds=None, overhead_seconds=20)
    idle = AdapterShare(adapter="idle", weight=1, min_share=0, demand_seconds=0, overhead_seconds=60)
    got = {s.adapter: s.seconds for s in water_fill(200, [a, b, idle])}
    assert got == pytest.approx({"a": 60 + 60, "b": 20 + 60, "idle": 0})  # 120 s of training, shared by weight


def test_an_adapters_relative_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "reg.jsonl").write_text('{"text": "x"}\n')
    s = load_settings(_config(tmp_path, """
[[adapters]]
name = "alpha"
sources = ["a-in", "b-in"]
eval = { regression_set = "reg.jsonl" }
"""))
    assert s.night_config().adapters[0].night.eval.regression_set == tmp_path / "reg.jsonl"


def test_webhooks_hear_each_adapters_own_rejection_in_a_night_that_succeeded(tmp_path):
    from daemon.notify import Notifier
    from jobs.contract import Outcome, RunSummary
    from jobs.hotswap import HotswapConfig
    from jobs.store.ledger import Ledger

    night = RunSummary(night="n", outcome=Outcome.succeeded, adapters=[
        RunSummary(night="n", adapter="a", outcome=Outcome.succeeded, version_name="a-v0001", promoted=True),
        RunSummary(night="n", adapter="c", outcome=Outcome.rejected, version_name="c-v0001")])
    events = Notifier(HotswapConfig(), Ledger(tmp_path / "ledger.sqlite")).events_of(night)
    assert [(e, f.get("adapter")) for e, _, f in events] == [("rejected", "c")]
    assert "c-v0001 of night n of adapter c was NOT promoted" in events[0][1]


def test_a_later_adapter_of_the_same_base_is_not_planned_with_calibrates_first_load():
    """On an H200 a night of four adapters in a 4-min window, planned from calibrate alone, gave each 45.5 s of
    overhead (calibrate's first load of the 8B, building its cache, 42.1 s of it; the night's loads took 5–7 s):
    the first adapter's slice held only its overhead and it trained nothing (RESULTS.md: 2026-11-28, four
    adapters vs one (H200)). A later adapter of the same base is planned without that load; once a night has
    measured itself, its own figures stand."""
    from jobs.contract.calibration import CalibrationRecord
    from jobs.night.several.night import later_overhead

    cal = CalibrationRecord.model_construct(overhead_seconds=45.5,
                                            overhead_detail={"load": 35.0, "evaluate": 9.9, "publish": 0.6})
    assert later_overhead(45.5, [{"origin": "calibrate"}], cal) == pytest.approx(10.5)
    assert later_overhead(9.5, [{"origin": "run"}, {"origin": "calibrate"}], cal) == 9.5  # measured by a night
    assert later_overhead(600.0, [], None) == 600.0  # the prior: nothing to take off
    shares = water_fill(240 - 30, [_share(n, demand=10.1).model_copy(update={"overhead_seconds": o}) for n, o in
                                   (("task1", 45.5), ("task2", 10.5), ("task3", 10.5), ("task4", 10.5))])
    first = shares[0]
    assert first.seconds - first.overhead_seconds >= 10.1  # room to train all it has, after its own overhead
