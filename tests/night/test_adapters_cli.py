"""The shipped example of two adapters (config/adapters.example.toml), end to end at the CLI on the CPU: `plan`
shares the window, `once` trains both on one base and lists each one's result, and the operator commands
(`status`, `adapters`, `doctor`) see each adapter."""

import json
import re

import pytest

from tests.conftest import REPO
from tests.daemon.test_cli import nightshift

pytestmark = pytest.mark.slow


def test_the_example_of_two_adapters_runs_a_night_and_each_is_seen(tmp_path):
    work = tmp_path / "work"
    for p in (REPO / "config").rglob("*"):
        if p.is_file():
            dest = work / p.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(p.read_bytes())
    env = {"PYTHONPATH": str(REPO)}
    cfg = ["--config", "config/adapters.example.toml"]
    r = nightshift(*cfg, "check-config", cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    r = nightshift(*cfg, "plan", "--json", cwd=work, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    shares = {s["adapter"]: s for s in plan["shares"]}
    assert shares["arith"]["pending_tokens"] > 0 and shares["chat"]["pending_tokens"] > 0
    assert shares["arith"]["weight"] == 2 and sum(s["share"] for s in plan["shares"]) == pytest.approx(1)
    assert plan["adapters"]["arith"]["train_tokens"] > 0 and plan["adapters"]["chat"]["train_tokens"] > 0
    assert not (work / "state-adapters" / "by-adapter" / "arith" / "ledger.sqlite").exists()  # a plan changes nothing

    r = nightshift(*cfg, "once", cwd=work, env=env, timeout=480)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.index("the window, shared by the adapters:") < out.index("train: started")  # planned before training
    assert re.search(r"^arith\s+succeeded\s+arith-v0001 \(promoted\)", out, re.M), out[-3000:]
    assert re.search(r"^chat\s+succeeded\s+chat-v0001 \(promoted\)", out, re.M)
    state = work / "state-adapters"
    for name in ("arith", "chat"):
        assert (state / "by-adapter" / name / "current" / "adapter_model.safetensors").exists()
    assert not (state / "current").exists()  # nothing of one adapter at the top

    # validate reads each file as the adapter whose source takes it (its own ledger knows it: already ingested)
    r = nightshift(*cfg, "validate", "config/sample-inbox/chat-2026-11-20.json", "--json", cwd=work, env=env)
    [check] = json.loads(r.stdout)
    assert check["source"] == "chat-inbox" and check["already_ingested"], check

    r = nightshift(*cfg, "status", "--json", cwd=work, env=env)
    info = json.loads(r.stdout)
    assert {n: a["in_service"]["name"] for n, a in info["adapters"].items()} == {"arith": "arith-v0001",
                                                                                 "chat": "chat-v0001"}
    r = nightshift(*cfg, "status", cwd=work, env=env)
    assert re.search(r"^chat\s+chat-v0001\s+\S+\s+succeeded", r.stdout, re.M), r.stdout
    r = nightshift(*cfg, "adapters", "list", cwd=work, env=env)
    assert r.returncode == 1 and "--adapter (arith, chat)" in r.stderr
    r = nightshift(*cfg, "adapters", "list", "--adapter", "chat", "--json", cwd=work, env=env)
    assert r.returncode == 0 and [v["name"] for v in json.loads(r.stdout)] == ["chat-v0001"], r.stdout
    r = nightshift(*cfg, "doctor", "--json", cwd=work, env=env)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"] and set(doc["adapters"]) == {"arith", "chat"}
