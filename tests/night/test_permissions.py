"""Permissions that match the deployment whatever the umask; receivers and logs learn no more than they must."""

from __future__ import annotations

import io
import json
import os
import threading

import structlog

from jobs.hotswap import AdapterRef
from jobs.hotswap.webhook import payload_bytes
from jobs.runtime import logs
from tests.conftest import alpaca, run, write_jsonl
from tests.fixtures.lora_servers import Fake
from tests.fixtures.night_events import StopAtProgress


def mode(p):
    return p.stat().st_mode & 0o777


def test_versions_are_group_readable_and_user_data_private_whatever_the_umask(night_env):
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(12)] + ["{not json"])
    # no periodic save: night 1's save time would enter night 2's plan (one a millisecond), which on a loaded box
    # fits no sample (skipped, not interrupted); n2's stop saves the checkpoint whose modes are checked
    cfg = make(train={"epochs": 2}, eval={"max_regression_increase_pct": None})
    old = os.umask(0o077)  # the strictest: versions must still reach the inference server's group
    try:
        s = run(cfg, night="n1")
    finally:
        os.umask(old)
    assert s["promoted"], s["error"]
    state = cfg.state_dir
    v1 = state / "adapters" / "tiny-v0001"
    assert mode(state) == 0o750 and mode(state / "adapters") == 0o750 and mode(v1) == 0o750
    assert all(mode(p) == 0o440 for p in v1.iterdir())
    stop = threading.Event()
    old = os.umask(0)  # the loosest: user data must still stay the service user's
    try:
        write_jsonl(inbox / "b.jsonl", [alpaca(i, "!") for i in range(12)] + ["{bad"])
        s = run(cfg, night="n2", stop=stop, events=StopAtProgress(stop))  # interrupted: checkpoints stay
    finally:
        os.umask(old)
    assert s["outcome"] == "interrupted"
    assert mode(state / "ledger.sqlite") == 0o600
    assert mode(state / "quarantine") == 0o700 and all(mode(p) == 0o600 for p in (state / "quarantine").iterdir())
    assert mode(state / "checkpoints") == 0o700 and mode(state / "checkpoints" / s["run_id"]) == 0o700
    inside = list((state / "checkpoints").rglob("*"))
    assert inside and all(mode(p) == (0o700 if p.is_dir() else 0o600) for p in inside)


def test_the_webhook_body_carries_the_version_not_the_other_targets(night_env):
    inbox, make = night_env
    hook, vllm = Fake("webhook"), Fake("vllm")
    try:
        write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
        cfg = make(eval={"max_regression_increase_pct": None}, hotswap={"targets": [
            {"kind": "webhook", "name": "deployer", "url": hook.url + "/hook", "retries": 0},
            {"kind": "vllm", "name": "private-vllm", "base_url": vllm.url + "/secret-path", "retries": 0,
             "api_key_env": "PRIVATE_VLLM_KEY_VAR"}]})
        s = run(cfg, night="n1")
        assert s["promoted"], s["error"]
        [req] = hook.posts("/hook")
    finally:
        hook.close()
        vllm.close()
    body = req["raw"].decode()
    assert json.loads(body)["version"] == 1
    for leak in (vllm.url, "secret-path", "PRIVATE_VLLM_KEY_VAR", hook.url):
        assert leak not in body
    manifest = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())
    assert manifest["config"]["hotswap"]["targets"] == [{"name": "deployer", "kind": "webhook"},
                                                       {"name": "private-vllm", "kind": "vllm"}]
    ref = AdapterRef(version=1, name="tiny-v0001", path=cfg.state_dir / "current", base_model="b", manifest=manifest)
    assert "secret-path" not in payload_bytes(ref).decode()


def test_tracebacks_in_the_log_carry_no_record_content():
    for fmt in ("json", "console"):
        out = io.StringIO()
        logs.configure("INFO", fmt, out)

        def ingest(record):
            text = record["instruction"]  # a frame local holding user data
            raise ValueError(f"bad record of {len(text)} characters")

        try:
            ingest({"instruction": "PATIENT NAME: " + "".join(["JA", "NE ", "ROE"])})  # data, not source code
        except ValueError:
            structlog.get_logger("nightshift.test").exception("run_failed")
        logged = out.getvalue()
        assert "ValueError" in logged and "ingest" in logged  # the traceback is there
        assert "JANE ROE" not in logged, fmt  # its locals are not
