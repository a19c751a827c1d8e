"""Announcing published versions (jobs.hotswap.versions): a night's outcome never depends on its
hot-swap; a rollback behind a stuck swap still tells the server; a start re-sends what a target missed;
the store itself never calls the network."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from typing import Any

from jobs.hotswap import HotswapConfig, versions
from jobs.store.adapters import Adapters, RegistryConfig
from jobs.store.ledger import Ledger
from jobs.store.outcomes import NightOutcomes
from tests.conftest import hang_bound
from tests.fixtures.lora_servers import Fake, start
from tests.store.test_adapters import bare, cli, craft, current, settings

REPO = Path(__file__).resolve().parents[2]


def test_the_store_imports_nothing_of_the_hotswap() -> None:
    """Issue 41: jobs/store is files, ledger and locks; telling servers lives above it."""
    for f in (REPO / "jobs" / "store").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("jobs.hotswap") for n in names), f"{f.name} imports {names}"


def test_a_run_killed_in_its_hotswap_is_recorded_promoted(tmp_path: Path) -> None:
    state = tmp_path / "state"
    craft(state, 1, run_id="2026-11-21-aaaa")
    led = Ledger(state / "ledger.sqlite")
    led.start_run("2026-11-21-aaaa", "2026-11-21", time.time() + 60)  # still open: the child was killed
    led.db.execute("UPDATE versions SET run_id='2026-11-21-aaaa' WHERE version=1")
    run_id = NightOutcomes(led).close("2026-11-21", "failed", "the window closed: SIGKILL")
    row = led.run(run_id)
    assert row["status"] == "succeeded" and "hot-swap was cut" in row["error"] and "SIGKILL" in row["error"]
    assert led.version(1)["status"] == "promoted"


def test_rollback_tells_the_server_behind_a_stuck_swap(tmp_path: Path, servers: list[Fake]) -> None:
    """A night's swap hangs on the server (its attempt ends at timeout_s); a rollback meanwhile waits for
    it as long as it can last, then the server hears the rollback, last."""
    srv = start(servers, "vllm")
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    real_load, stuck = srv._load, threading.Event()

    def hang_first(h: Any, body: dict[str, Any]) -> None:
        if not stuck.is_set():
            stuck.set()
            time.sleep(5)  # longer than the attempt's deadline: the client gives up at 4 s
        real_load(h, body)

    srv._load = hang_first  # type: ignore[method-assign]
    target = {"kind": "vllm", "name": "vllm", "base_url": srv.url, "retries": 0, "timeout_s": 4, "keep_loaded": 1}
    cfg = HotswapConfig.model_validate({"targets": [target]})
    ad = Adapters(state, cfg=RegistryConfig(lock_timeout_seconds=0.5))
    night = threading.Thread(target=versions.send, args=(ad, cfg), kwargs={"trigger": "night"})
    night.start()
    assert stuck.wait(30)
    # 2 s of the lock's own wait: room for the night to record its failed attempt on a busy box, and still short of
    # the 4 s attempt (the old wait, lock_timeout alone, gave up while the night held the lock)
    s = settings(state, target, lock_timeout=2)
    assert cli(s, "adapters", "rollback") == 0  # waited for the stuck swap (old: "busy" after 2 s, never told)
    night.join(hang_bound(30))
    assert current(state) == "tiny-v0001"
    assert bare(srv.loaded) == ["tiny-v0001"]
    led = Ledger(state / "ledger.sqlite")
    assert [(r["version"], r["trigger"], bool(r["ok"])) for r in led.hotswaps()] == [(2, "night", False),
                                                                                      (1, "rollback", True)]


def test_a_start_resends_what_a_target_missed(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    state = tmp_path / "state"
    craft(state, 1)
    good = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "vllm", "base_url": srv.url}]})
    down = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "vllm", "retries": 0,
                                                      "base_url": "http://127.0.0.1:9"}]})
    ad = Adapters(state)
    assert versions.send(ad, down, trigger="night")[1][0].ok is False  # type: ignore[index]
    [o] = versions.resend_if_unheard(ad, good) or []
    assert o.ok and bare(srv.loaded) == ["tiny-v0001"]
    assert versions.resend_if_unheard(ad, good) is None  # heard: nothing to do
    assert [r["trigger"] for r in Ledger(state / "ledger.sqlite").hotswaps(1)] == ["night", "start"]
