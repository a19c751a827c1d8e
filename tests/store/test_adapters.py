"""`nightshift adapters ...` / `nightshift hotswap` through the CLI handlers, on crafted versions
(Registry.publish + ledger rows, as the night writes them), against a loopback fake vLLM; and one
slow test on real tiny-model nights with a real consumer (peft hot-swaps v0001 -> v0002 in place)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.adapters_cli import add_commands
from jobs.contract import ExitCode
from jobs.hotswap import HotswapConfig
from jobs.store.adapters import RegistryConfig
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.registry import Registry, version_name
from tests.conftest import hang_bound
from tests.fixtures.lora_servers import Fake

NAME = "tiny"


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def vllm() -> Iterator[Fake]:
    srv = Fake("vllm")
    yield srv
    srv.close()


def settings(
    state: Path, *targets: dict[str, Any], keep: int = 5, lock_timeout: float = 10.0, newest: Path | None = None
) -> SimpleNamespace:
    """What the handlers read from Settings: state_dir, [hotswap], [registry]."""
    return SimpleNamespace(
        state_dir=state,
        hotswap=HotswapConfig.model_validate({"targets": list(targets), "newest_name_file": newest}),
        registry=RegistryConfig(keep_promoted=keep, lock_timeout_seconds=lock_timeout),
    )


def vllm_target(srv: Fake, **kw: Any) -> dict[str, Any]:
    return {"kind": "vllm", "name": "vllm", "base_url": srv.url, "retries": 0, **kw}


def bare(names: Any) -> list[str]:
    """Served names (`tiny-v0002-1a2b3c4d`) without their digest."""
    return [re.sub(r"-[0-9a-f]{8}$", "", n) for n in names]


def cli(s: SimpleNamespace, *argv: str) -> int:
    ap = argparse.ArgumentParser()
    add_commands(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(list(argv))
    return args.func(args, s)


def craft(
    state: Path,
    version: int,
    *,
    status: str = "promoted",
    rank: int = 4,
    heldout: float = 1.0,
    content: bytes | None = None,
    run_id: str | None = None,
) -> Path:
    """Publish a version the way the night does: tmp dir -> publish -> ledger -> current (if promoted)."""
    reg, led = Registry(state), Ledger(state / "ledger.sqlite")
    name = version_name(NAME, version)
    led.db.execute(
        "INSERT INTO versions (version, name, run_id, parent, status, created_at) VALUES (?,?,?,?,?,?)",
        (version, name, run_id or f"run-{version}", reg.current_version(), "training", time.time()),
    )
    tmp = reg.new_tmp_dir(name)
    (tmp / "adapter_model.safetensors").write_bytes(content or f"weights of {version}".encode() * 100)
    (tmp / "adapter_config.json").write_text(json.dumps({"r": rank}))
    passed = status == "promoted"
    manifest = {
        "version": version,
        "name": name,
        "parent_version": reg.current_version(),
        "base_model": {"path": "/models/tiny", "fingerprint": "f"},
        "config": {"train": {"lora_rank": rank, "learning_rate": 1e-3}},
        "losses": {
            "heldout_before": 1.5,
            "heldout_after": heldout,
            "regression_before": None,
            "regression_after": None,
        },
        "data": {"samples": 10 * version},
        "gate": {"passed": passed, "checks": []},
        "promoted": passed,
    }
    path = reg.publish(tmp, NAME, version, manifest)
    with led.tx() as c:
        led.set_version(c, version, status=status, path=str(path), manifest=manifest, promoted=passed)
        if passed:
            led.record_promotion(c, version, action="night", from_version=reg.current_version())
    if passed:
        reg.promote(path)
    led.close()
    return path


def current(state: Path) -> str | None:
    cur = Registry(state).current()
    return cur.name if cur else None


# ---- reading ------------------------------------------------------------------------------------


def test_list_show_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    craft(state, 1, heldout=1.2)
    craft(state, 2, status="rejected", heldout=1.9)
    craft(state, 3, rank=8, heldout=0.9)
    s = settings(state)
    assert cli(s, "adapters", "pin", "1") == 0
    capsys.readouterr()

    assert cli(s, "adapters", "list") == 0
    lines = {
        ln.split()[1] if ln.startswith("*") else ln.split()[0]: ln
        for ln in capsys.readouterr().out.splitlines()
        if "tiny-v" in ln
    }
    assert lines["tiny-v0003"].startswith("*") and "promoted" in lines["tiny-v0003"]
    assert "rejected" in lines["tiny-v0002"] and "failed" in lines["tiny-v0002"]  # gate column
    assert lines["tiny-v0001"].rstrip().endswith("pinned") and not lines["tiny-v0001"].startswith("*")
    assert "0.9000" in lines["tiny-v0003"]

    assert cli(s, "adapters", "list", "--json") == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tiny-v0003"]["in_service"] and rows["tiny-v0001"]["pinned"]
    assert rows["tiny-v0002"]["gate"] == "failed" and rows["tiny-v0001"]["heldout_loss"] == 1.2

    assert cli(s, "adapters", "show", "tiny-v0002", "--json") == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["version"] == 2 and set(manifest["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert cli(s, "adapters", "show", "current") == 0
    assert capsys.readouterr().out.startswith("# tiny-v0003: promoted, IN SERVICE")

    assert cli(s, "adapters", "diff", "1", "v0003") == 0
    out = capsys.readouterr().out
    assert re.search(r"config\.train\.lora_rank +4 -> 8  \(\+4, \+100\.0%\)", out)
    assert "losses.heldout_after" in out and "config.train.learning_rate" not in out  # equal: not shown
    assert "files." not in out
    assert cli(s, "adapters", "diff", "1", "3", "--json") == 0
    keys = {r["key"] for r in json.loads(capsys.readouterr().out)}
    assert {"config.train.lora_rank", "version", "name", "data.samples"} <= keys

    assert cli(s, "adapters", "show", "99") == ExitCode.FAILED
    assert "no version '99'" in capsys.readouterr().err


# ---- promote, integrity, rollback ---------------------------------------------------------------


def test_promote_verifies_moves_current_records_and_notifies(
    tmp_path: Path, vllm: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2, status="rejected")
    craft(state, 3)
    s = settings(state, vllm_target(vllm), newest=tmp_path / "newest")
    assert cli(s, "adapters", "promote", "2") == 0  # any kept version, a rejected one too (operator's call)
    assert current(state) == "tiny-v0002"
    assert "tiny-v0002 is in service (was tiny-v0003)" in capsys.readouterr().out
    led = Ledger(state / "ledger.sqlite")
    row = led.version(2)
    assert row["status"] == "promoted" and row["promoted_at"] is not None
    assert [(r["version"], r["action"], r["from_version"]) for r in led.promotions()][-1] == (2, "promote", 3)
    [hs] = led.hotswaps(2)
    assert hs["ok"] == 1 and hs["trigger"] == "promote" and hs["target"] == "vllm"
    assert bare(vllm.loaded) == ["tiny-v0002"]
    assert list(vllm.loaded.values()) == [str((state / "adapters/tiny-v0002").resolve())]
    assert bare([(tmp_path / "newest").read_text().strip()]) == ["tiny-v0002"]
    assert (tmp_path / "newest").read_text() == f"{next(iter(vllm.loaded))}\n"
    assert cli(s, "adapters", "promote", "2") == ExitCode.FAILED  # already in service
    assert "already in service" in capsys.readouterr().err


def test_a_corrupted_adapter_is_refused_and_current_stays(
    tmp_path: Path, vllm: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    v1 = craft(state, 1)
    craft(state, 2)
    s = settings(state, vllm_target(vllm))
    weights = v1 / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    assert cli(s, "adapters", "promote", "1") == ExitCode.FAILED
    err = capsys.readouterr().err
    assert "adapter_model.safetensors does not match its sha256" in err and "tiny-v0002 stays in service" in err
    assert current(state) == "tiny-v0002" and vllm.requests == []
    assert cli(s, "adapters", "rollback") == ExitCode.FAILED  # the rollback target is the same bad one
    assert current(state) == "tiny-v0002" and vllm.requests == []
    assert cli(s, "hotswap", "--version", "1") == ExitCode.FAILED  # never sent to a server either
    assert vllm.requests == []
    led = Ledger(state / "ledger.sqlite")
    assert led.version(1)["promoted_at"] < led.version(2)["promoted_at"] and not led.hotswaps()


def test_rollback_walks_back_the_service_history_and_notifies(
    tmp_path: Path, vllm: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    for v in (1, 2, 3):
        craft(state, v)
    s = settings(state, vllm_target(vllm, keep_loaded=3))
    assert cli(s, "adapters", "rollback") == 0
    assert current(state) == "tiny-v0002" and "rolled back: tiny-v0002 is in service (was tiny-v0003)" in (
        capsys.readouterr().out
    )
    assert cli(s, "adapters", "rollback") == 0
    assert current(state) == "tiny-v0001"
    assert cli(s, "adapters", "rollback") == ExitCode.FAILED  # nothing before v1; v2/v3 were rolled back from
    assert "no earlier promoted version" in capsys.readouterr().err and current(state) == "tiny-v0001"
    assert cli(s, "adapters", "promote", "3") == 0
    assert cli(s, "adapters", "rollback") == 0  # undoes that promote
    assert current(state) == "tiny-v0001"
    loads = [r["body"]["lora_name"] for r in vllm.posts("/v1/load_lora_adapter")]
    assert bare(loads) == ["tiny-v0002", "tiny-v0001", "tiny-v0003"]  # v0001 still held at the last rollback
    led = Ledger(state / "ledger.sqlite")
    assert [r["trigger"] for r in led.hotswaps()] == ["rollback", "rollback", "promote", "rollback"]
    assert all(r["ok"] for r in led.hotswaps())


def test_a_failed_hotswap_never_undoes_the_promotion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    down = Fake("fail", status=400)
    try:
        s = settings(state, {"kind": "vllm", "name": "down", "base_url": down.url, "retries": 0})
        assert cli(s, "adapters", "rollback") == ExitCode.HOTSWAP_FAILED
    finally:
        down.close()
    assert current(state) == "tiny-v0001"
    assert "hot-swap down (vllm): FAILED" in capsys.readouterr().err
    [row] = Ledger(state / "ledger.sqlite").hotswaps(1)
    assert row["ok"] == 0 and "HTTP 400" in row["error"]


def test_hotswap_resends_the_one_in_service(tmp_path: Path, vllm: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    s = settings(state, vllm_target(vllm))
    assert cli(s, "hotswap") == 0
    capsys.readouterr()
    assert cli(s, "hotswap", "--json") == 0  # already loaded: still a success
    lines = capsys.readouterr().out.splitlines()  # (unconfigured structlog also writes to stdout)
    sent = json.loads("\n".join(lines[lines.index("{") :]))
    assert sent["name"] == "tiny-v0002" and sent["outcomes"][0]["detail"]["already_loaded"] is True
    assert bare(vllm.loaded) == ["tiny-v0002"]
    assert cli(s, "hotswap", "--version", "1") == 0
    assert "sent tiny-v0001 (NOT the version in service)" in capsys.readouterr().out
    assert current(state) == "tiny-v0002"
    assert [r["trigger"] for r in Ledger(state / "ledger.sqlite").hotswaps()] == ["resend"] * 3


# ---- pin, prune, the lock -----------------------------------------------------------------------


def test_prune_keeps_in_service_pinned_last_k_and_anything_being_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2, status="rejected")
    for v in (3, 4, 5, 6):
        craft(state, v)
    s = settings(state, keep=2)
    assert cli(s, "adapters", "rollback") == 0  # current: v5; last 2 promoted: v5 (rollback) and v6
    assert cli(s, "adapters", "pin", "1") == 0
    led = Ledger(state / "ledger.sqlite")
    # a night in progress: version 7 reserved ('training'), its files half-written under .tmp-
    led.db.execute(
        "INSERT INTO versions (version, name, run_id, parent, status, created_at) "
        "VALUES (7, 'tiny-v0007', 'r7', 3, 'training', 0)"
    )
    half = Registry(state).new_tmp_dir("tiny-v0007")
    (half / "adapter_model.safetensors").write_bytes(b"half")
    capsys.readouterr()

    assert cli(s, "adapters", "prune", "--dry-run") == 0
    assert "would delete: tiny-v0002, tiny-v0004" in capsys.readouterr().out
    assert (state / "adapters/tiny-v0002").is_dir()
    assert cli(s, "adapters", "prune") == 0
    out = capsys.readouterr().out
    assert "deleted: tiny-v0002, tiny-v0004" in out
    assert "kept tiny-v0003: parent of tiny-v0007, being trained" in out and "kept tiny-v0001: pinned" in out
    assert f"left alone {half.name}" in out
    on_disk = sorted(p.name for p in (state / "adapters").iterdir())
    assert on_disk == sorted([half.name, "tiny-v0001", "tiny-v0003", "tiny-v0005", "tiny-v0006"])
    assert current(state) == "tiny-v0005"
    assert {r["version"]: r["status"] for r in led.versions()} == {
        1: "promoted",
        2: "pruned",
        3: "promoted",
        4: "pruned",
        5: "promoted",
        6: "promoted",
        7: "training",
    }
    assert led.next_version() == 8  # names are never reused
    pruned = led.db.execute("SELECT version FROM events WHERE kind='pruned' ORDER BY id")
    assert [r["version"] for r in pruned] == [2, 4]
    assert cli(s, "adapters", "show", "4", "--json") == 0  # the ledger keeps a pruned version's manifest
    assert json.loads(capsys.readouterr().out)["version"] == 4
    assert cli(s, "adapters", "promote", "4") == ExitCode.FAILED  # its files are gone
    assert "pruned" in capsys.readouterr().err
    assert cli(s, "adapters", "rollback") == 0  # history: 1, 3, 4, 5 (6 was rolled back from): v4 is gone
    assert current(state) == "tiny-v0003"
    assert cli(s, "adapters", "unpin", "1") == 0
    assert 1 not in led.pinned()


def test_prune_racing_a_publish_waits_for_it_and_deletes_nothing_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2, status="rejected")
    s = settings(state, keep=1, lock_timeout=hang_bound(60))  # waits for the publish, however slow the box
    held, times = threading.Event(), {}

    def night_publish() -> None:  # what night_train does under the lock: a .tmp- dir, then publish
        with StateLock(state / "lock", what="publish"):
            held.set()
            reg = Registry(state)
            tmp = reg.new_tmp_dir("tiny-v0003")
            time.sleep(0.4)  # writing the adapter
            tmp.rmdir()
            craft(state, 3)
            times["released"] = time.monotonic()

    t = threading.Thread(target=night_publish)
    t.start()
    assert held.wait(hang_bound(5))
    assert cli(s, "adapters", "prune") == 0
    times["pruned"] = time.monotonic()
    t.join()
    assert times["pruned"] >= times["released"]  # prune waited for the publish
    assert current(state) == "tiny-v0003" and (state / "adapters/tiny-v0003/manifest.json").is_file()
    assert "kept tiny-v0003: in service" in capsys.readouterr().out
    assert sorted(p.name for p in (state / "adapters").iterdir()) == ["tiny-v0003"]


def test_a_busy_lock_is_reported_and_nothing_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    s = settings(state, lock_timeout=0.2)
    with StateLock(state / "lock", what="publish"):
        assert cli(s, "adapters", "rollback") == ExitCode.BUSY  # waited lock_timeout_seconds, then status 5
        assert cli(s, "adapters", "prune") == ExitCode.BUSY
    err = capsys.readouterr().err
    assert "held by another nightshift process" in err and "for rollback" in err
    assert current(state) == "tiny-v0002"


def test_the_cli_module_imports_no_torch() -> None:
    code = (
        "import sys, daemon.adapters_cli; "
        "print([m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "[]"


# ---- real nights, a real consumer ---------------------------------------------------------------


@pytest.mark.slow
def test_nights_hotswap_and_peft_swaps_v1_for_v2_in_place(
    night_env: Any, tiny_model: Path, vllm: Fake, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from peft.utils.hotswap import hotswap_adapter
    from transformers import AutoModelForCausalLM

    from tests.conftest import alpaca, run, write_jsonl

    inbox, make = night_env
    newest = tmp_path / "newest"
    cfg = make(hotswap={"targets": [vllm_target(vllm)], "newest_name_file": newest}, eval={"min_eval_samples": 1})
    state = cfg.state_dir
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    events: list[dict[str, Any]] = []
    s1 = run(cfg, events=events)
    assert s1["promoted"] and s1["hotswap"][0]["ok"] and s1["replay_samples"] == 0  # nothing earlier to replay
    hs = [e for e in events if e["event"] == "hotswap"]
    assert [(e["version"], e["outcome"]["target"], e["outcome"]["ok"]) for e in hs] == [(1, "vllm", True)]
    assert [e["state"] for e in events if e["event"] == "phase" and e["phase"] == "hotswap"] == ["start", "end"]
    assert bare(vllm.loaded) == ["tiny-v0001"] and newest.read_text() == f"{next(iter(vllm.loaded))}\n"

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])

    def logits(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    consumer = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(state / "current"))
    consumer.eval()
    before = logits(consumer)

    write_jsonl(inbox / "b.jsonl", [alpaca(i, " please") for i in range(20)])
    s2 = run(cfg, night="2026-11-22", events=events)
    assert s2["promoted"] and s2["version_name"] == "tiny-v0002" and s2["hotswap"][0]["ok"]
    assert bare(vllm.loaded) == ["tiny-v0001", "tiny-v0002"] and newest.read_text() == f"{list(vllm.loaded)[1]}\n"
    led = Ledger(state / "ledger.sqlite")
    assert [(r["version"], r["trigger"], r["ok"]) for r in led.hotswaps()] == [(1, "night", 1), (2, "night", 1)]
    assert [(r["version"], r["action"]) for r in led.promotions()] == [(1, "night"), (2, "night")]
    # replay: earlier samples trained again, listed with their role, never re-marked
    replayed = [sid for sid, role in led.run_samples(s2["run_id"]) if role == "replay"]
    assert s2["replay_samples"] == len(replayed) > 0
    assert {
        r[0]
        for r in led.db.execute(f"SELECT version FROM samples WHERE id IN ({','.join('?' * len(replayed))})", replayed)
    } == {1}
    manifest = json.loads((state / "current/manifest.json").read_text())
    assert manifest["data"]["replay_samples"] == len(replayed) and manifest["replay_share"] == 0.5
    # the gate's numbers: measured metrics; the default rules on night 1's held-out samples (the regression set)
    assert 0 <= manifest["metrics"]["heldout_after"]["exact_match"] <= 1
    assert manifest["metrics"]["heldout_after"]["loss"] == s2["losses"]["heldout_after"]
    checks = manifest["gate"]["checks"]
    assert [c["name"] for c in checks][:2] == ["regression.exact_match", "regression.token_accuracy"]
    assert all(c["passed"] for c in checks)

    # the real consumer: swap v0001 for v0002 in place; outputs become exactly v0002's
    hotswap_adapter(consumer, str(state / "current"), adapter_name="default")
    after = logits(consumer)
    v2 = str(state / "adapters/tiny-v0002")
    direct = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), v2)
    direct.eval()
    assert not torch.equal(after, before)
    assert torch.equal(after, logits(direct))

    # rollback through the CLI: current moves back, vLLM and the consumer follow
    s = settings(state, vllm_target(vllm), newest=newest)
    assert cli(s, "adapters", "rollback") == 0
    assert current(state) == "tiny-v0001" and newest.read_text() == f"{next(iter(vllm.loaded))}\n"
    hotswap_adapter(consumer, str(state / "current"), adapter_name="default")
    assert torch.equal(logits(consumer), before)

    # an operator moves `current` while a night trains: the night publishes but does not promote
    class PromoteWhileTraining(list):
        def append(self, ev: dict[str, Any]) -> None:
            if ev.get("event") == "phase" and ev["phase"] == "train" and ev["state"] == "start":
                assert cli(s, "adapters", "promote", "2") == 0

    write_jsonl(inbox / "c.jsonl", [alpaca(i, " now") for i in range(10)])
    # the gate itself left out of it (sets below min_eval_samples are not judged): only the move of `current` holds
    # the candidate back (on this tiny model the gate may also refuse it against v0002, the new reference)
    quiet = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"min_eval_samples": 10_000})})
    s3 = run(quiet, night="2026-11-23", events=PromoteWhileTraining())
    assert s3["outcome"] == "rejected" and not s3["promoted"] and "changed during the night" in s3["gate"]["held_back"]
    assert current(state) == "tiny-v0002" and led.version(3)["status"] == "rejected" and not led.hotswaps(3)


def test_the_nights_hotswap_phase_records_failures_and_never_raises(tmp_path: Path) -> None:
    import threading

    from jobs.contract import RunSummary
    from jobs.night.config import NightConfig
    from jobs.night.context import RunContext
    from jobs.night.publish import announce_version

    state = tmp_path / "state"
    v1 = craft(state, 1)
    down = Fake("fail", status=503)
    try:
        cfg = NightConfig.model_validate(
            {
                "state_dir": state,
                "model": {"path": tmp_path / "model", "name": NAME},
                "hotswap": {
                    "targets": [{"kind": "sglang", "name": "sg", "base_url": down.url, "retries": 1, "backoff_s": 0}]
                },
            }
        )
        led, events = Ledger(state / "ledger.sqlite"), []
        n = RunContext(cfg=cfg, ledger=led, registry=Registry(state), emit=lambda e: events.append(e.model_dump()),
                       clock=time.time, stop=threading.Event(), night="n", deadline=0.0, run_id="run-1",
                       model_path=tmp_path / "model", fingerprint="f", summary=RunSummary())
        announce_version(n, 1, v1)
    finally:
        down.close()
    [ev] = [e for e in events if e["event"] == "hotswap"]
    o = ev["outcome"]
    assert ev["version"] == 1 and o["target"] == "sg" and o["kind"] == "sglang" and not o["ok"]
    assert o["attempts"] == 2 and "HTTP 503" in o["error"]
    assert [(r["trigger"], r["run_id"], r["ok"]) for r in led.hotswaps(1)] == [("night", "run-1", 0)]
    assert [e["state"] for e in events if e["event"] == "phase"] == ["start", "end"]

    (v1 / "adapter_config.json").write_text("{}")  # altered after publication: never announced
    events.clear()
    announce_version(n, 1, v1)
    assert "does not match its sha256" in n.summary.hotswap_error and len(led.hotswaps(1)) == 1
    assert current(state) == "tiny-v0001" and [e["event"] for e in events] == ["phase", "phase"]
