"""Whole nights on the tiny model, in-process (the CLI and the child process are tested in test_cli.py)."""

import json
import threading

import pytest

from jobs.store.ledger import Ledger
from tests.conftest import alpaca, run, write_jsonl

pytestmark = pytest.mark.slow


def ledger_of(cfg):
    return Ledger(cfg.state_dir / "ledger.sqlite")


def test_two_nights_quarantine_publish_continue_and_load(night_env, tiny_model):
    inbox, make = night_env
    cfg = make(eval={"min_eval_samples": 1})  # 3 held-out samples: evaluate them anyway
    write_jsonl(inbox / "good.jsonl", [alpaca(i) for i in range(40)])
    write_jsonl(inbox / "bad.jsonl", [alpaca(100), "{oops", {"instruction": "no output"}])
    s1 = run(cfg)
    assert s1["outcome"] == "succeeded" and s1["version_name"] == "tiny-v0001" and s1["promoted"]
    assert s1["quarantined"] == {"invalid_json": 1, "missing_field": 1}
    q = [json.loads(x) for x in (cfg.state_dir / "quarantine" / f"{s1['run_id']}.jsonl").read_text().splitlines()]
    assert {e["reason"] for e in q} == {"invalid_json", "missing_field"} and all(e["line"] for e in q)
    current = cfg.state_dir / "current"
    assert current.resolve().name == "tiny-v0001"
    manifest = json.loads((current / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["parent_version"] is None
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest["files"])
    assert manifest["config"]["train"]["lora_rank"] == 4 and manifest["base_model"]["fingerprint"]
    assert manifest["data"]["samples"] == s1["trained_samples"] == 41 - s1["heldout_samples"]
    assert s1["losses"]["heldout_after"] < s1["losses"]["heldout_before"]

    # night 2: one new file repeating old samples, one with new ones
    write_jsonl(inbox / "again.jsonl", [alpaca(1), alpaca(2), alpaca(500)])
    write_jsonl(inbox / "more.jsonl", [alpaca(i, " please") for i in range(20)])
    s2 = run(cfg, night="2026-11-22")
    assert s2["outcome"] == "succeeded" and s2["version"] == 2 and s2["parent_version"] == 1
    assert s2["duplicates"] == 2 and sum(s2["ingested"].values()) == 21
    assert s2["trained_samples"] + s2["heldout_samples"] == 21
    led = ledger_of(cfg)
    by_version = dict(led.db.execute("SELECT version, COUNT(*) FROM samples WHERE status='trained' GROUP BY version"))
    assert by_version == {1: s1["trained_samples"], 2: s2["trained_samples"]}
    assert led.sample_counts().get("pending", 0) == 0
    assert len(led.throughput_history(led.throughput_history.__self__.db.execute(
        "SELECT key FROM throughput LIMIT 1").fetchone()[0])) == 2
    for tokens, overhead, detail in led.db.execute("SELECT tokens, overhead_seconds, detail FROM throughput"):
        d = json.loads(detail)  # the steady rate without the first step (a compile); the overhead holds it
        assert d["warmup_tokens"] > 0 and tokens > 0 and overhead >= d["warmup_seconds"] > 0
    assert json.loads((current / "manifest.json").read_text())["plan"]["basis"].startswith("measured")

    # a real consumer: peft loads the adapter behind `current` onto the base model and generates
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(current))
    ids = tok.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_more_data_than_the_window_allows_is_deferred_then_taken(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "big.jsonl", [alpaca(i) for i in range(120)])
    # an hour, of which the prior says 3,580 s go to overheads: 20 s x 100 tok/s x 0.9 = 1,800 tokens
    cfg = make(plan={"prior_tokens_per_second": 100, "prior_overhead_seconds": 3580, "heldout_share": 0})
    s1 = run(cfg)
    assert s1["outcome"] == "succeeded" and s1["deferred_samples"] > 0
    assert s1["trained_samples"] + s1["deferred_samples"] == 120
    assert s1["backlog_samples"] == s1["deferred_samples"]
    s2 = run(cfg, night="2026-11-22")  # an hour: the measured throughput makes room for the rest
    assert s2["trained_samples"] == s1["deferred_samples"] and s2["deferred_samples"] == 0
    led = ledger_of(cfg)
    assert led.sample_counts() == {"trained": 120}


def test_stop_signal_checkpoints_and_the_rerun_resumes_without_retraining(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(60)])
    cfg = make(plan={"heldout_share": 0}, train={"epochs": 3, "batch_size": 4})
    stop = threading.Event()
    events = []

    class StopAfter(list):
        def append(self, ev):
            events.append(ev)
            if ev.event == "progress":  # the first step always reports (then at most once a second)
                stop.set()

    import time

    from jobs.night.run import run_night
    s1 = run_night(cfg, night="n", deadline=time.time() + 3600, emit=StopAfter().append, stop=stop).model_dump()
    assert s1["outcome"] == "interrupted"
    assert (cfg.state_dir / "checkpoints" / s1["run_id"] / "latest" / "state.json").exists()
    led = ledger_of(cfg)
    assert led.sample_counts() == {"pending": 60}  # nothing marked trained by an interrupted run
    assert led.open_run("n")["id"] == s1["run_id"]
    assert not (cfg.state_dir / "current").exists()

    s2 = run(cfg, night="n")
    assert s2["run_id"] == s1["run_id"] and s2["outcome"] == "succeeded"
    manifest = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())
    done_before = manifest["training"]["resumed_from_step"]
    assert done_before >= 1
    # 60 samples / 4 per batch x 3 epochs, but the unmeasured night opens with two probe steps
    probed = sum(manifest["training"]["probe_samples"])
    batches = manifest["training"]["batches"]
    assert len(manifest["training"]["probe_samples"]) == 2 and batches == 2 + -(-(60 - probed) // 4) + 2 * 15
    assert s2["steps"] == batches  # every batch exactly once across both attempts
    assert led.sample_counts() == {"trained": 60}
    assert not (cfg.state_dir / "checkpoints" / s1["run_id"]).exists()


def test_gate_rejects_a_worse_adapter_and_current_stays(night_env, tmp_path):
    inbox, make = night_env
    reg = write_jsonl(tmp_path / "regression.jsonl", [alpaca(i) for i in range(1000, 1010)])
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    assert run(make(eval={"regression_set": reg}))["promoted"]
    write_jsonl(inbox / "b.jsonl", [{"text": "zebra quantum " * 10} for _ in range(1)] +
                [{"text": f"noise {i} " * 12} for i in range(30)])
    # the fixed file is the canary (issue 39): measured apart, and gating here by an operator's rule on it
    bad = make(eval={"regression_set": reg, "gate": [{"data": "canary", "metric": "loss", "max_worse_pct": 0}],
                     "alpha": None},  # the point figures decide
               train={"learning_rate": 0.5, "epochs": 3})
    s = run(bad, night="2026-11-22")
    assert s["outcome"] == "rejected" and not s["promoted"]
    assert s["metrics"]["canary_after"]["loss"] > s["metrics"]["canary_before"]["loss"]
    assert (bad.state_dir / "current").resolve().name == "tiny-v0001"
    assert (bad.state_dir / "adapters" / "tiny-v0002" / "manifest.json").exists()  # kept, marked
    led = ledger_of(bad)
    assert led.version(2)["status"] == "rejected" and led.version(1)["status"] == "promoted"


def test_crash_after_the_ledger_recorded_the_version_only_finishes(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    cfg = make()
    s = run(cfg, night="n")
    led = ledger_of(cfg)
    # simulate a kill between the ledger's commit and the `current` swap
    led.db.execute("UPDATE runs SET status='running', ended_at=NULL WHERE id=?", (s["run_id"],))
    (cfg.state_dir / "current").unlink()
    s2 = run(cfg, night="n")
    assert s2["run_id"] == s["run_id"] and s2["outcome"] == "succeeded" and s2["steps"] == 0
    assert (cfg.state_dir / "current").resolve().name == "tiny-v0001"
    assert [r["version"] for r in led.versions()] == [1]


def test_nothing_new_is_a_skipped_night(night_env):
    _, make = night_env
    s = run(make())
    assert s["outcome"] == "skipped" and "no new samples" in s["error"]


def test_a_packed_night_trains_every_sample_in_fewer_fuller_steps(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(40)])
    cfg = make(plan={"heldout_share": 0}, train={"batching": "packed", "tokens_per_step": 256})
    s = run(cfg)
    assert s["outcome"] == "succeeded" and s["trained_samples"] == 40
    manifest = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())
    t = manifest["training"]
    assert t["batching"] == "packed" and t["tokens_per_step"] == 256 and "from config" in t["step_shape_basis"]
    assert s["steps"] == t["batches"] < 40 / 8  # fewer steps than 8-sample padded batches would take


def test_calibrations_record_goes_through_the_ledger_into_the_nights_step_shape(night_env):
    """The calibrate -> night hand-off: the step shape calibrate chose is the one the night trains with
    (a string "off" once became checkpointing on here)."""
    from jobs.contract import MemoryModel
    from jobs.night.model import model_fingerprint, throughput_key
    from jobs.training.probe import ProbeResult, Throughput, calibration_record

    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(40)])
    cfg = make(train={"batching": "packed", "tokens_per_step": "auto", "gradient_checkpointing": "auto"},
               plan={"heldout_share": 0})
    probe = ProbeResult(memory=MemoryModel(static_gb=6.0, mb_per_token=3.5), tokens_per_step=384)
    rates = {"alpaca": Throughput(tokens=12_000, seconds=2.0, steps=8), "wiki": Throughput(11_000, 2.0, 8)}
    record = calibration_record(probe, rates, gradient_checkpointing=False, max_vram_gb=40, device="cpu",
                                versions={"torch": "x"})
    led = ledger_of(cfg)
    led.record_calibration(throughput_key(cfg, model_fingerprint(cfg.model.path), "hf", "cpu"), record,
                           tokens=11_000, seconds=2.0)
    led.close()
    s = run(cfg)
    assert s["outcome"] in ("succeeded", "rejected"), s["error"]
    assert s["step_shape"]["tokens_per_step"] == 384 and s["step_shape"]["gradient_checkpointing"] is False
    assert "calibrated" in s["step_shape"]["basis"] and "calibrate" in s["plan_basis"]
    training = json.loads((cfg.state_dir / "adapters" / "tiny-v0001" / "manifest.json").read_text())["training"]
    assert training["tokens_per_step"] == 384 and training["gradient_checkpointing"] is False  # as loaded
    # calibrate's rate at these samples' length: short ones (~20 tokens) take the short profile's 6,000 tok/s
    assert s["plan"]["tokens_per_second"] == 6_000 and "tokens a sample (calibrate's length line)" in s["plan_basis"]
