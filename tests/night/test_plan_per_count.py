"""The planner reads the throughput measured for the night's number of ranks (cards), not another count's."""

import threading
import time

from jobs.night.model import model_fingerprint, throughput_key
from jobs.night.run import run_night
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, write_jsonl


def plan_of(cfg):
    return run_night(cfg, night="plan", deadline=time.time() + 3600, emit=lambda _: None, stop=threading.Event(),
                     plan_only=True).plan


def test_a_plan_for_two_ranks_uses_what_two_ranks_measured(night_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU host: gpus = 2 is 2 CPU processes
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    two, one = make(train={"gpus": 2}), make(train={"gpus": 1})
    led = Ledger(two.state_dir / "ledger.sqlite")
    fp = model_fingerprint(two.model.path)
    led.record_throughput(key=throughput_key(two, fp, "hf", "cpu", gpus=2), run_id=None, origin="run",
                          tokens=7_000, seconds=1.0, overhead_seconds=0.0, detail={})
    led.close()
    p2 = plan_of(two)
    assert p2.measured and p2.tokens_per_second == 7_000
    p1 = plan_of(one)
    assert not p1.measured and "prior" in p1.basis  # one process has measured nothing yet
