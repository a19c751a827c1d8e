"""Nights of several adapters ([[adapters]]) on the tiny model: each adapter gated, versioned and resumed on its
own; one's rejection or exception never stops or rolls back another's; a kill -9 between adapters loses nothing
and trains nothing twice."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs.night.config import NightConfig
from jobs.night.several.config import AdapterConfig, with_adapters
from jobs.store.paths import StatePaths
from jobs.store.readonly import open_read_only
from tests.conftest import alpaca, hang_bound, write_jsonl

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, tiny_model: Path, names=("a", "b", "c"), **per_adapter) -> NightConfig:
    """Three adapters, each with its own inbox (tmp_path/<name>-in) and whatever `per_adapter[name]` sets."""
    for n in names:
        (tmp_path / f"{n}-in").mkdir(exist_ok=True)
    base = NightConfig.model_validate({
        "state_dir": tmp_path / "state", "model": {"path": tiny_model, "name": "tiny"},
        "sources": [{"name": f"{n}-in", "inbox": tmp_path / f"{n}-in", "settle_seconds": 0} for n in names],
        "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.1},
        "train": {"backend": "hf", "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "batch_size": 8,
                  "batching": "padded", "max_tokens_per_batch": 2048, "max_seq_length": 128,
                  "gradient_checkpointing": False, "checkpoint_every_seconds": 600},
        "eval": {"min_eval_samples": 1}})
    return with_adapters(base, [AdapterConfig(name=n, sources=[f"{n}-in"], **per_adapter.get(n, {})) for n in names])


def _fill(tmp_path: Path, names=("a", "b", "c"), n: int = 20) -> None:
    for k, name in enumerate(names):
        write_jsonl(tmp_path / f"{name}-in" / "d.jsonl", [alpaca(100 * k + i, f" {name}") for i in range(n)])


def _night(cfg: NightConfig, night: str = "2026-11-21", seconds: float = 3600):
    from jobs.night.several.night import run_adapters

    events: list = []
    s = run_adapters(cfg, night=night, deadline=time.time() + seconds, emit=events.append, stop=threading.Event())
    return s, events


def _ledger(cfg: NightConfig, name: str):
    return open_read_only(StatePaths(cfg.state_dir).adapter(name).ledger)


def _counts(cfg: NightConfig, name: str) -> dict:
    led = _ledger(cfg, name)
    try:
        return {"samples": led.sample_counts(), "versions": [(r["version"], r["status"]) for r in led.versions()]}
    finally:
        led.close()


def test_three_adapters_three_versions_one_rejected_leaves_the_others_promoted(tmp_path, tiny_model):
    reg = write_jsonl(tmp_path / "regression.jsonl", [alpaca(i) for i in range(1000, 1010)])
    bad = {"eval": {"regression_set": str(reg), "alpha": None,
                    "gate": [{"data": "canary", "metric": "loss", "max_worse_pct": 0}]},
           "train": {"learning_rate": 0.5, "epochs": 3}}
    cfg = _config(tmp_path, tiny_model, c=bad, a={"weight": 2})
    _fill(tmp_path, ("a", "b"))
    write_jsonl(tmp_path / "c-in" / "d.jsonl", [{"text": f"noise {i} " * 12} for i in range(20)])  # wrong labels
    s, events = _night(cfg)
    by = {x.adapter: x for x in s.adapters}
    assert [x.adapter for x in s.adapters] == ["a", "b", "c"]
    assert by["a"].promoted and by["a"].version_name == "a-v0001" and by["b"].version_name == "b-v0001"
    assert by["b"].promoted and by["c"].outcome.value == "rejected" and not by["c"].promoted
    assert s.outcome.value == "succeeded" and "c: rejected" in (s.error or "")
    for name in ("a", "b"):  # each its own registry and `current`
        paths = StatePaths(cfg.state_dir).adapter(name)
        assert paths.current.resolve().name == f"{name}-v0001"
        manifest = json.loads((paths.current / "manifest.json").read_text())
        assert manifest["data"]["samples"] == by[name].trained_samples
    c = StatePaths(cfg.state_dir).adapter("c")
    assert not c.current.exists() and (c.adapters / "c-v0001" / "manifest.json").exists()  # kept, marked
    assert _counts(cfg, "c")["versions"] == [(1, "rejected")]
    assert not (StatePaths(cfg.state_dir).adapters).exists()  # nothing of one adapter at the top
    # the plan over adapters came before anything trained, and every event names its adapter
    kinds = [(e.event, e.adapter) for e in events]
    shares_at = kinds.index(("shares", ""))
    assert all(k[0] != "progress" for k in kinds[:shares_at]) and {a for e, a in kinds if e == "progress"} == {
        "a", "b", "c"}
    shares = {x.adapter: x for x in s.shares}
    assert shares["a"].pending_tokens > 0 and shares["a"].weight == 2 and sum(x.share for x in s.shares) == (
        pytest.approx(1))
    assert [e.summary.adapter for e in events if e.event == "result"] == ["a", "b", "c"]
    # one measured throughput for the base: the adapters of the same shape share their key (top ledger)
    top = open_read_only(StatePaths(cfg.state_dir).ledger)
    try:
        keys = {r["key"] for r in top.db.execute("SELECT key FROM throughput")}
        rows = top.db.execute("SELECT COUNT(*) FROM throughput").fetchone()[0]
        assert len(keys) == 1 and rows == 3  # a, b and c (a rejected night is measured too)
        assert top.night_done("2026-11-21")
    finally:
        top.close()


def test_an_exception_in_one_adapter_leaves_the_others_promoted_and_its_retry_resumes_it(tmp_path, tiny_model,
                                                                                      monkeypatch):
    import jobs.night.run as night_run

    cfg = _config(tmp_path, tiny_model, names=("a", "b"))
    _fill(tmp_path, ("a", "b"))
    real = night_run.load_model_and_data

    def broken(ctx, planned, tokenizer):
        if ctx.cfg.model.name == "a":
            raise RuntimeError("a record this adapter's data could not take")
        return real(ctx, planned, tokenizer)

    monkeypatch.setattr(night_run, "load_model_and_data", broken)
    s, _ = _night(cfg)
    by = {x.adapter: x for x in s.adapters}
    assert by["a"].outcome.value == "failed" and "could not take" in by["a"].error
    assert by["b"].promoted and s.outcome.value == "failed" and s.error.startswith("a: failed")
    assert _counts(cfg, "a") == {"samples": {"pending": 20}, "versions": [(1, "training")]}  # open, nothing lost
    b_before = _counts(cfg, "b")
    monkeypatch.setattr(night_run, "load_model_and_data", real)
    s2, _ = _night(cfg)  # the supervisor's retry: the same night's run, resumed
    assert s2.run_id == s.run_id and s2.outcome.value == "succeeded"
    by2 = {x.adapter: x for x in s2.adapters}
    assert by2["a"].promoted and by2["a"].run_id == by["a"].run_id  # its own open run, resumed
    assert by2["b"].run_id == by["b"].run_id and _counts(cfg, "b") == b_before  # not trained again
    assert set(_counts(cfg, "a")["samples"]) <= {"trained", "heldout"}


def _child(cfg: NightConfig, night: str, crash_at: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NIGHTSHIFT_CRASH_AT", None)
    if crash_at:
        env["NIGHTSHIFT_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "jobs.night.child", "--night", night, "--deadline",
                           repr(time.time() + 3600)], input=cfg.model_dump_json(), capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=hang_bound(900))


def test_kill_9_between_adapters_then_resume_loses_nothing_and_trains_nothing_twice(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model)
    _fill(tmp_path, n=16)
    first = _child(cfg, "n1", "night.adapter_done@1")  # killed right after adapter a closed its run
    assert first.returncode == -9, first.stderr[-2000:]
    assert _counts(cfg, "a")["versions"] == [(1, "promoted")]
    assert _counts(cfg, "b")["versions"] == [] and _counts(cfg, "b")["samples"] == {"pending": 16}  # pulled, kept
    a_after_kill = _counts(cfg, "a")
    again = _child(cfg, "n1", None)
    assert again.returncode == 0, again.stderr[-2000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])["summary"]
    assert [(x["adapter"], x["outcome"]) for x in result["adapters"]] == [
        ("a", "succeeded"), ("b", "succeeded"), ("c", "succeeded")]
    assert _counts(cfg, "a") == a_after_kill  # not trained twice
    for name in ("a", "b", "c"):
        got = _counts(cfg, name)
        assert got["versions"] == [(1, "promoted")]
        assert sum(got["samples"].values()) == 16 and set(got["samples"]) <= {"trained", "heldout"}  # 0 lost
