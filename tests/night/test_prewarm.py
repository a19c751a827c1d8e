"""A night's process started before its window (`[window] prewarm_seconds`): it imports, waits for the
opening, and only then opens its run; its wake -> first step counts from the opening."""

import json
import threading
import time

import pytest

from daemon.settings import load_settings
from daemon.supervisor import NightChild
from jobs.contract import ExitCode, Outcome
from jobs.store.ledger import Ledger
from tests.conftest import alpaca, hang_bound, toml_config, write_jsonl


def start_child(tmp_path, tiny_model, lead):
    cfg, inbox = toml_config(tmp_path, tiny_model)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(12)])
    settings = load_settings(cfg)
    opening = time.time() + lead
    lines: list[str] = []

    class Log:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

        def isatty(self):
            return False

    child = NightChild(settings.night_config().model_dump_json(), night="2026-11-25", deadline=opening + 300,
                       start_at=opening, log_stream=Log())
    child.start()
    return child, opening, lines, settings


def test_the_child_waits_for_the_opening_and_times_its_first_step_from_there(tmp_path, tiny_model):
    child, opening, lines, settings = start_child(tmp_path, tiny_model, lead=15)  # a slow box imports in ~5 s
    out = child.wait(timeout=hang_bound(300))
    assert out.returncode == ExitCode.OK and out.summary is not None, out.tail
    assert out.summary.outcome == Outcome.succeeded
    led = Ledger(settings.state_dir / "ledger.sqlite")
    try:
        [run] = led.db.execute("SELECT * FROM runs").fetchall()
    finally:
        led.close()
    assert run["started_at"] >= opening - 0.01  # no run opened, nothing pulled, before the window
    prewarmed = [json.loads(x) for x in lines if '"prewarmed"' in x]
    [p] = prewarmed
    # the lead counts from the process's start (its imports, then its wait): no bound on how long a busy box's
    # imports take, which ate more than the 5 s `10 <= lead` left them
    assert 0 <= p["waits_seconds"] <= max(0.0, p["lead_seconds"]) and p["lead_seconds"] <= 15
    if p["waits_seconds"] > 0:  # imported before the opening: the lead is the two legs (each rounded to 0.1 s)
        assert p["lead_seconds"] == pytest.approx(p["import_seconds"] + p["waits_seconds"], abs=0.15)
    imported = [json.loads(x) for x in lines if '"imported"' in x]  # the wake's first leg, logged in every child
    assert len(imported) == 1 and 0 < imported[0]["seconds"] <= prewarmed[0]["import_seconds"] + 0.1
    first_step_at = opening + out.summary.first_step_seconds
    assert opening < first_step_at <= time.time()


def test_a_child_stopped_before_the_opening_opens_no_run(tmp_path, tiny_model):
    lead = hang_bound(120)  # the imports end before the opening, even on a busy box: it is stopped while it waits
    child, _, lines, settings = start_child(tmp_path, tiny_model, lead=lead)
    waiting = threading.Event()
    deadline = time.monotonic() + lead
    while time.monotonic() < deadline and not waiting.is_set():
        if any('"prewarmed"' in x for x in lines):
            waiting.set()
        time.sleep(0.1)
    assert waiting.is_set(), lines
    out = child.stop(grace=30)
    assert out.returncode == ExitCode.INTERRUPTED and out.summary.outcome == Outcome.interrupted
    assert out.summary.error == "stopped before the window opened"
    if (settings.state_dir / "ledger.sqlite").exists():
        led = Ledger(settings.state_dir / "ledger.sqlite")
        try:
            assert not led.db.execute("SELECT * FROM runs").fetchall()
        finally:
            led.close()


def test_unsloth_is_imported_with_its_cache_locations_already_set(tmp_path, monkeypatch):
    """Unsloth reads UNSLOTH_COMPILE_LOCATION when imported (else it writes `unsloth_compiled_cache` into the
    working directory, as the H200 host showed); the child imports it first thing, so the caches come first."""
    import importlib.abc
    import importlib.machinery
    import os
    import sys

    import torch

    from jobs.night import child

    seen = {}

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            seen["compile_location"] = os.environ.get("UNSLOTH_COMPILE_LOCATION")
            seen["offline"] = os.environ.get("HF_HUB_OFFLINE")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, Loader()) if name == "unsloth" else None

    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for k in ("UNSLOTH_COMPILE_LOCATION", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "UNSLOTH_MEGA_CACHE_DIR",
              "UNSLOTH_MEGA_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
              "UNSLOTH_DISABLE_STATISTICS"):
        monkeypatch.delenv(k, raising=False)
    child._import_unsloth_first({"state_dir": str(tmp_path / "state"), "train": {"backend": "auto"}})
    assert seen["compile_location"] == str(tmp_path / "state" / "models" / "compile" / "unsloth_compiled_cache")
    assert seen["offline"] == "1"


@pytest.mark.usefixtures("workers_at_our_priority")
def test_the_pull_workers_start_from_the_night_config_before_any_import(tmp_path, tiny_model, monkeypatch):
    """The child starts them before it imports Unsloth (~20 s on an H200 host), from the config's JSON: each
    worker loads the model's tokenizer itself, as this process may not import transformers before Unsloth."""
    import jobs.data.parallel as parallel
    from jobs.night.intake import start_pull_workers

    monkeypatch.setattr(parallel, "default_workers", lambda: 2)
    night = {"state_dir": str(tmp_path / "state"), "model": {"path": str(tmp_path / "absent")}}
    start_pull_workers(json.dumps(night))  # built at the night: not yet
    start_pull_workers(json.dumps({"state_dir": str(tmp_path / "state"), "model": {}}))
    assert parallel._early is None
    start_pull_workers(json.dumps({**night, "model": {"path": str(tiny_model)}}))
    try:
        assert parallel._early is not None and parallel._early.workers == 2
        assert parallel._early.ready is not None and parallel._early.ready.result(timeout=hang_bound(300))
    finally:
        parallel.close_early()
