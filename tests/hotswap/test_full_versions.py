"""A full fine-tuned version (a whole model directory) announced to every target kind, against the
loopback fakes (tests/fixtures/lora_servers.py): vLLM refuses it, SGLang reloads its weights from
disk, commands and webhooks receive the model directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.contract import Method, version_name
from jobs.hotswap import AdapterRef, HotswapConfig, notify_all
from tests.fixtures.lora_servers import BASE, Fake, start


def model_version(tmp_path: Path, version: int) -> AdapterRef:
    d = tmp_path / "adapters" / version_name("tiny", version)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 8)
    return AdapterRef(version=version, name=d.name, path=d, base_model=BASE, method=Method.full,
                      manifest={"version": version, "method": "full", "kind": "model"})


def cfg(*targets: dict[str, Any], **top: Any) -> HotswapConfig:
    return HotswapConfig.model_validate({"targets": list(targets), **top})


def no_sleep(_: float) -> None:
    raise AssertionError("a refusal is not retried")


def test_vllm_refuses_a_full_version_clearly_and_sends_nothing(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    newest = tmp_path / "newest"
    c = cfg({"kind": "vllm", "name": "vllm", "base_url": srv.url, "retries": 3}, newest_name_file=str(newest))
    [out] = notify_all(c, model_version(tmp_path, 2), sleep=no_sleep)
    assert not out.ok and out.attempts == 0 and srv.requests == []
    assert "tiny-v0002 is a full fine-tuned model" in (out.error or "")
    assert "vLLM has no production API to reload a whole model" in (out.error or "")
    assert "`command`" in (out.error or "") and not newest.exists()


def test_vllm_cannot_be_configured_to_reload_whole_models() -> None:
    with pytest.raises(ValidationError, match="vLLM has no production API"):
        cfg({"kind": "vllm", "name": "v", "base_url": "http://127.0.0.1:1", "full_versions": "reload"})


def test_sglang_reloads_the_weights_from_the_version_directory(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "sglang")
    newest = tmp_path / "newest"
    c = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url}, newest_name_file=str(newest))
    a = model_version(tmp_path, 3)
    [out] = notify_all(c, a, sleep=no_sleep)
    assert out.ok and out.attempts == 1, out
    [req] = srv.posts("/update_weights_from_disk")
    assert req["body"] == {"model_path": str(a.path), "weight_version": "tiny-v0003"}
    assert srv.weights_from == str(a.path) and srv.loaded == {}  # no LoRA route was used
    assert out.detail["message"] == "Succeeded to update model weights. Weight version updated to tiny-v0003."
    assert newest.read_text() == "tiny-v0003\n"


def test_sglang_reload_failure_and_refusal(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "sglang")
    broken = model_version(tmp_path, 4)
    (broken.path / "config.json").unlink()  # the server cannot read a model there: 400, not retried
    [out] = notify_all(cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "retries": 3}), broken,
                       sleep=no_sleep)
    assert not out.ok and out.attempts == 1 and "HTTP 400" in (out.error or "") and "has no model" in out.error
    off = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "full_versions": "refuse"})
    [out] = notify_all(off, model_version(tmp_path, 5), sleep=no_sleep)
    assert not out.ok and 'full_versions = "refuse"' in (out.error or "") and len(srv.requests) == 1


def test_sglang_remote_dir_applies_to_model_directories(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "sglang")
    remote = tmp_path / "mounted"
    (remote / "tiny-v0006").mkdir(parents=True)
    (remote / "tiny-v0006" / "config.json").write_text("{}")
    c = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "remote_adapters_dir": str(remote)})
    assert notify_all(c, model_version(tmp_path, 6), sleep=no_sleep)[0].ok
    assert srv.weights_from == f"{remote}/tiny-v0006"


def test_command_and_webhook_receive_the_model_directory(tmp_path: Path, servers: list[Fake]) -> None:
    seen = tmp_path / "seen.json"
    script = ("import json, os, sys; json.dump({'path': sys.argv[2], 'method': os.environ['NIGHTSHIFT_METHOD'], "
              "'files': sorted(os.listdir(sys.argv[2]))}, open(sys.argv[1], 'w'))")
    hook = start(servers, "webhook")
    c = cfg({"kind": "command", "name": "c", "argv": [sys.executable, "-c", script, str(seen)]},
            {"kind": "webhook", "name": "w", "url": hook.url})
    a = model_version(tmp_path, 7)
    cmd, web = notify_all(c, a, sleep=no_sleep)
    assert cmd.ok and web.ok, (cmd, web)
    assert json.loads(seen.read_text()) == {"path": str(a.path), "method": "full",
                                             "files": ["config.json", "model.safetensors"]}
    payload = json.loads(hook.requests[0]["raw"])
    assert payload["method"] == "full" and payload["path"] == str(a.path) and payload["manifest"]["kind"] == "model"
