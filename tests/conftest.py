"""Shared fixtures: one tiny random-initialised model per test session, built offline."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.lora_servers import servers  # noqa: F401  (a fixture: loopback vLLM/SGLang servers)
from tests.fixtures.real_vllm import vllm_server  # noqa: F401  (a fixture: the session's real vLLM)

REPO = Path(__file__).resolve().parents[1]
SAMPLE_INBOX = REPO / "config" / "sample-inbox"


@pytest.fixture
def workers_at_our_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pull workers at this test's priority, not 10 below it (jobs/data/parallel.py: WORKER_NICENESS).

    Beside CPU hogs at nice 0 (load ~15-25 on 2 cores) a worker at +10 weighs ~1/10 of each hog (the scheduler's
    weights), so its tokenizer took minutes to load and a pull-worker test ~200 s (issue 42). What the tests check
    does not hang on the niceness; test_workers_run_behind_the_nights_own_process checks the shipped one.
    """
    import jobs.data.parallel as parallel

    monkeypatch.setattr(parallel, "WORKER_NICENESS", 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files marked `long` first: the two workers take them at the start and end together (issue 42).

    xdist hands out whole files (`--dist loadfile`) in this order (`--no-loadscope-reorder`); its own order,
    most tests first, left a one-test file of 26 minutes for last at load ~15 while the other worker idled.
    """
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: within a group, as collected


def hang_bound(seconds: float) -> float:
    """A timeout that only catches a hang: `seconds` on an idle machine, stretched by how busy it is now (load
    per core; a 2-core CI box at load 15: x7.5, at most 30 minutes). A test never asserts on it."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(1800.0, seconds * max(1.0, os.getloadavg()[0] / cores))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jobs.training.models.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    return build_tiny_llama(out, sorted(SAMPLE_INBOX.glob("*.json*")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from jobs.training.load import load_tokenizer

    return load_tokenizer(tiny_model)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def alpaca(i: int, tag: str = "") -> dict[str, str]:
    return {"instruction": f"Add {i} and {i + 1}{tag}.", "output": f"{i} + {i + 1} = {2 * i + 1}"}


@pytest.fixture()
def night_env(tmp_path: Path, tiny_model: Path):
    """A state dir, an empty inbox and a NightConfig factory pointing at them."""
    from jobs.night.config import NightConfig

    inbox = tmp_path / "inbox"
    inbox.mkdir()

    def make(**over: Any) -> NightConfig:
        base: dict[str, Any] = {
            "state_dir": tmp_path / "state",
            "model": {"path": tiny_model, "name": "tiny"},
            "sources": [{"name": "inbox", "inbox": inbox, "settle_seconds": 0}],
            "plan": {"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.1},
            "train": {"backend": "hf", "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "batch_size": 8,
                      "batching": "padded",
                      "max_tokens_per_batch": 2048, "max_seq_length": 128, "gradient_checkpointing": False,
                      "checkpoint_every_seconds": 600},
        }
        for section, values in over.items():
            if isinstance(values, dict) and isinstance(base.get(section), dict):
                base[section] = {**base[section], **values}
            else:
                base[section] = values
        return NightConfig.model_validate(base)

    return inbox, make


def run(cfg: Any, *, night: str = "2026-11-21", seconds: float = 3600, stop: threading.Event | None = None,
        events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    from jobs.night.run import run_night

    """One night in this process; the summary and the events as the JSON they cross the pipe as."""
    sink = events if events is not None else []
    summary = run_night(cfg, night=night, deadline=time.time() + seconds,
                        emit=lambda ev: sink.append(ev.model_dump(mode="json")), stop=stop or threading.Event())
    return summary.model_dump(mode="json")


def copy_samples(inbox: Path) -> None:
    for p in SAMPLE_INBOX.iterdir():
        shutil.copy(p, inbox / p.name)


def toml_config(tmp_path: Path, tiny_model: Path, *, more: str = "", **train: Any) -> tuple[Path, Path]:
    """A config file for CLI/daemon subprocess tests: tiny model, an empty inbox, `[train]` overrides,
    and `more` TOML appended after it (e.g. `[window]`). Returns (config path, inbox)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir(exist_ok=True)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in train.items())
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / "state"}"
[model]
path = "{tiny_model}"
name = "tiny"
[[sources]]
name = "inbox"
inbox = "{inbox}"
settle_seconds = 0
[plan]
prior_tokens_per_second = 2000
prior_overhead_seconds = 0
heldout_share = 0
[train]
backend = "hf"
batching = "padded"
lora_rank = 4
max_seq_length = 128
gradient_checkpointing = false
{extra}
{more}""")
    return cfg, inbox
