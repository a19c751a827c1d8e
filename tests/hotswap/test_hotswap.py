"""Hot-swap against real loopback HTTP servers that behave as vLLM / SGLang document
(tests/fixtures/lora_servers.py)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from jobs.contract import parse_version_name, version_name
from jobs.hotswap import (
    AdapterRef,
    HotswapConfig,
    notify_all,
    plan_unloads,
    verify_signature,
)
from jobs.hotswap.lora_server import Client, ours
from tests.conftest import hang_bound
from tests.fixtures.lora_servers import BASE, Fake, start

DIGEST = AdapterRef(version=1, name="t-v0001", path=Path("/x"), base_model=BASE,
                    manifest={"files": {"adapter_config.json": "ab" * 32}}).digest



def listed(target: Any) -> list[str]:
    """Our versions the server lists now, oldest first (what the swap's detail calls loaded)."""
    return ours(Client(target).served()[0] or {}, "tiny")

def adapter(tmp_path: Path, version: int, prefix: str = "tiny") -> AdapterRef:
    d = tmp_path / "adapters" / version_name(prefix, version)
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text("{}")
    return AdapterRef(
        version=version,
        name=d.name,
        path=d,
        base_model=BASE,
        manifest={"version": version, "files": {"adapter_config.json": "ab" * 32}},
    )


def sn(v: int, prefix: str = "tiny") -> str:
    """The served name of adapter(tmp_path, v): every version of these tests has the same files' digest."""
    return f"{version_name(prefix, v)}-{DIGEST}"


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def cfg(*targets: dict[str, Any], **top: Any) -> HotswapConfig:
    return HotswapConfig.model_validate({"targets": list(targets), **top})


# -- configuration ---------------------------------------------------------------------------
def test_config_from_toml_picks_each_kind() -> None:
    doc = tomllib.loads("""
        newest_name_file = "/tmp/x/newest"
        [[targets]]
        kind = "vllm"
        name = "v"
        base_url = "http://127.0.0.1:8000/"
        [[targets]]
        kind = "sglang"
        name = "s"
        base_url = "https://gpu.example:30000"
        keep_loaded = 3
        ca_bundle = "/etc/ssl/lab-ca.pem"
        [[targets]]
        kind = "webhook"
        name = "w"
        url = "https://hooks.example/x"
        token_env = "TOK"
        hmac_secret_file = "/etc/nightshift/hmac"
        [[targets]]
        kind = "command"
        name = "c"
        argv = ["/bin/true"]
        timeout_s = 5
    """)
    c = HotswapConfig.model_validate(doc)
    assert [type(t).__name__ for t in c.targets] == [
        "LoraServerTarget",
        "LoraServerTarget",
        "WebhookTarget",
        "CommandTarget",
    ]
    v = c.targets[0]
    assert v.base_url == "http://127.0.0.1:8000" and v.keep_loaded == 2 and v.verify_tls  # type: ignore[union-attr]
    assert c.targets[1].keep_loaded == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("key", ["token", "api_key", "hmac_secret"])
def test_config_refuses_clear_text_secrets(key: str) -> None:
    kind = {"token": "webhook", "api_key": "vllm", "hmac_secret": "webhook"}[key]
    t = {"kind": kind, "name": "x", key: "s3cret"}
    t.update({"url": "https://h.example/"} if kind == "webhook" else {"base_url": "http://127.0.0.1:1"})
    with pytest.raises(ValidationError) as e:
        cfg(t)
    assert f"'{key}' must not be written in clear" in str(e.value)
    assert f"{key}_file" in str(e.value) and f"{key}_env" in str(e.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "vllm", "name": "x", "base_url": "file:///etc/passwd"},
        {"kind": "vllm", "name": "x", "base_url": "http://user:pw@127.0.0.1:1"},
        {"kind": "webhook", "name": "x", "url": "https://h.example", "token_file": "/a", "token_env": "B"},
        {"kind": "vllm", "name": "x", "base_url": "http://127.0.0.1:1", "keep_loaded": 0},
        {"kind": "command", "name": "x", "argv": []},
        {"kind": "command", "name": "x", "argv": ["/bin/true"], "verify_tls": False},
        {"kind": "ftp", "name": "x"},
    ],
)
def test_config_rejects_bad_targets(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        cfg(bad)


def test_config_rejects_duplicate_names() -> None:
    t = {"kind": "command", "name": "same", "argv": ["/bin/true"]}
    with pytest.raises(ValidationError, match="two targets are named 'same'"):
        cfg(t, t)


def test_versioned_names(tmp_path: Path) -> None:
    assert version_name("tiny", 7) == "tiny-v0007"
    assert parse_version_name("tiny-v0007") == ("tiny", 7)
    assert parse_version_name("my-model-v12345") == ("my-model", 12345)
    assert parse_version_name(BASE) is None and parse_version_name("tiny-v7") is None
    with pytest.raises(ValueError, match="not '<prefix>-v0008'"):
        AdapterRef(version=8, name="tiny-v0007", path=tmp_path, base_model=BASE)
    with pytest.raises(ValueError, match="absolute"):
        AdapterRef(version=7, name="tiny-v0007", path=Path("rel"), base_model=BASE)


def test_plan_unloads_keeps_just_loaded_and_newest_others() -> None:
    names = ["t-v0001", "t-v0002", "t-v0003", "t-v0004"]
    assert plan_unloads(names, "t-v0004", 2) == ["t-v0001", "t-v0002"]
    assert plan_unloads(names, "t-v0004", 1) == ["t-v0001", "t-v0002", "t-v0003"]
    assert plan_unloads(names, "t-v0002", 2) == ["t-v0001", "t-v0003"]  # rollback: keep v2 + v4
    assert plan_unloads(names, "t-v0004", 9) == []
    assert plan_unloads(["t-v0003"], "t-v0003", 1) == []


# -- vLLM ------------------------------------------------------------------------------------
def test_vllm_loads_versioned_names_and_honours_keep_loaded(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    srv.loaded.update({"sql-lora": "/elsewhere/sql", "big-v0001": "/elsewhere/big"})  # not ours
    c = cfg({"kind": "vllm", "name": "vllm", "base_url": srv.url, "keep_loaded": 2})
    for v in range(1, 6):
        a = adapter(tmp_path, v)
        before = sorted((p.name, p.stat().st_mtime_ns) for p in a.path.iterdir())
        [out] = notify_all(c, a, sleep=Sleeps())
        assert out.ok and out.attempts == 1 and out.error is None, out
        assert out.kind == "vllm" and out.target == "vllm"
        assert out.detail["loaded"] == [sn(n) for n in range(max(1, v - 1), v + 1)]
        assert sorted((p.name, p.stat().st_mtime_ns) for p in a.path.iterdir()) == before  # untouched
        assert listed(c.targets[0]) == out.detail["loaded"]
    loads = [r["body"] for r in srv.posts("/v1/load_lora_adapter")]
    assert [b["lora_name"] for b in loads] == [sn(v) for v in range(1, 6)]
    assert all(Path(b["lora_path"]).is_absolute() and b["lora_name"].startswith(Path(b["lora_path"]).name + "-")
               for b in loads)
    assert [r["body"]["lora_name"] for r in srv.posts("/v1/unload_lora_adapter")] == [
        sn(1),
        sn(2),
        sn(3),
    ]
    assert set(srv.loaded) == {"sql-lora", "big-v0001", sn(4), sn(5)}


def test_vllm_resend_of_a_loaded_name_is_success(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    c = cfg({"kind": "vllm", "name": "vllm", "base_url": srv.url})
    a = adapter(tmp_path, 7)
    assert notify_all(c, a, sleep=Sleeps())[0].detail["already_loaded"] is False
    [again] = notify_all(c, a, sleep=Sleeps())
    assert again.ok and again.attempts == 1 and again.detail["already_loaded"] is True
    assert len(srv.posts("/v1/load_lora_adapter")) == 1 and list(srv.loaded) == [sn(7)]  # seen held: not re-sent


def test_vllm_rollback_keeps_the_version_just_loaded(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    c = cfg({"kind": "vllm", "name": "vllm", "base_url": srv.url, "keep_loaded": 2})
    for v in (3, 4, 5):
        notify_all(c, adapter(tmp_path, v), sleep=Sleeps())
    assert set(srv.loaded) == {sn(4), sn(5)}
    [out] = notify_all(c, adapter(tmp_path, 3), sleep=Sleeps())  # roll back to v3
    assert out.ok and out.detail["unloaded"] == [sn(4)]
    assert set(srv.loaded) == {sn(3), sn(5)}


def test_vllm_bearer_api_key(tmp_path: Path, servers: list[Fake], monkeypatch: pytest.MonkeyPatch) -> None:
    srv = start(servers, "vllm", api_key="k-123")
    keyfile = tmp_path / "key"
    keyfile.write_text("k-123\n")
    keyfile.chmod(0o600)
    ok = cfg({"kind": "vllm", "name": "a", "base_url": srv.url, "api_key_file": str(keyfile)})
    assert notify_all(ok, adapter(tmp_path, 1), sleep=Sleeps())[0].ok
    monkeypatch.setenv("WRONG_KEY", "nope")
    bad = cfg({"kind": "vllm", "name": "b", "base_url": srv.url, "api_key_env": "WRONG_KEY", "retries": 3})
    [out] = notify_all(bad, adapter(tmp_path, 2), sleep=Sleeps())
    assert not out.ok and out.attempts == 1 and "HTTP 401" in (out.error or "")  # 401 is not retried
    unset = cfg({"kind": "vllm", "name": "c", "base_url": srv.url, "api_key_env": "NOT_SET_ANYWHERE"})
    [out] = notify_all(unset, adapter(tmp_path, 3), sleep=Sleeps())
    assert not out.ok and "NOT_SET_ANYWHERE is not set" in (out.error or "")


def test_vllm_missing_route_or_adapter_is_not_retried(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "sglang")  # vLLM routes absent: like VLLM_ALLOW_RUNTIME_LORA_UPDATING unset
    sleeps = Sleeps()
    c = cfg({"kind": "vllm", "name": "v", "base_url": srv.url, "retries": 3})
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=sleeps)
    assert not out.ok and out.attempts == 1 and sleeps == [] and "HTTP 404" in (out.error or "")
    srv2 = start(servers, "vllm")
    gone = AdapterRef(version=2, name="tiny-v0002", path=tmp_path / "missing", base_model=BASE)
    [out] = notify_all(cfg({"kind": "vllm", "name": "v", "base_url": srv2.url}), gone, sleep=sleeps)
    assert not out.ok and "No adapter found" in (out.error or "")


def test_remote_adapters_dir_rewrites_the_path(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    remote = tmp_path / "mounted"
    (remote / "tiny-v0001").mkdir(parents=True)
    c = cfg({"kind": "vllm", "name": "v", "base_url": srv.url, "remote_adapters_dir": str(remote) + "/"})
    assert notify_all(c, adapter(tmp_path, 1), sleep=Sleeps())[0].ok
    assert srv.loaded[sn(1)] == f"{remote}/tiny-v0001"


# -- SGLang ----------------------------------------------------------------------------------
def test_sglang_same_policy(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "sglang")
    c = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "keep_loaded": 1})
    for v in (1, 2, 3):
        [out] = notify_all(c, adapter(tmp_path, v), sleep=Sleeps())
        assert out.ok and out.kind == "sglang" and out.detail["loaded"] == [sn(v)]
    assert list(srv.loaded) == [sn(3)]
    assert [r["body"]["lora_name"] for r in srv.posts("/unload_lora_adapter")] == [sn(1), sn(2)]
    assert not srv.posts("/v1/load_lora_adapter")  # SGLang's routes have no /v1
    [again] = notify_all(c, adapter(tmp_path, 3), sleep=Sleeps())
    assert again.ok and again.detail["already_loaded"]


def test_sglang_load_is_confirmed_from_its_answer_where_v1_models_lists_only_the_base(
    tmp_path: Path, servers: list[Fake]
) -> None:
    """SGLang 0.4.9 to 0.5.4.post1: /v1/models lists the base model alone; the load answer's
    `loaded_adapters` is what says the adapter is held (the hot-swap used to fail here)."""
    srv = start(servers, "sglang-base-only")
    c = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "keep_loaded": 2})
    for v in (1, 2, 3):
        [out] = notify_all(c, adapter(tmp_path, v), sleep=Sleeps())
        assert out.ok, out.error
        assert out.detail["confirmed_by"] == "load response"
        assert out.detail["loaded"] == [sn(n) for n in range(max(1, v - 1), v + 1)]
    assert list(srv.loaded) == [sn(2), sn(3)]  # keep_loaded, from the answer's list
    assert [r["body"]["lora_name"] for r in srv.posts("/unload_lora_adapter")] == [sn(1)]
    # a re-send: SGLang says "already loaded" (its error answer lists nothing here): held, so a success
    [again] = notify_all(c, adapter(tmp_path, 3), sleep=Sleeps())
    assert again.ok and again.detail["already_loaded"] and again.attempts == 1
    assert listed(c.targets[0]) == []  # /v1/models cannot tell on this build


def test_a_lora_server_that_cannot_confirm_a_load_is_a_clear_failure(tmp_path: Path, servers: list[Fake]) -> None:
    """An answer without `loaded_adapters` and a /v1/models without adapters: not confirmed, not retried."""
    srv = start(servers, "sglang-base-only")
    real = srv._sglang_answer
    srv._sglang_answer = lambda ok, msg: {**real(ok, msg), "loaded_adapters": None}  # type: ignore[method-assign]
    c = cfg({"kind": "sglang", "name": "sg", "base_url": srv.url, "retries": 3})
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=Sleeps())
    assert not out.ok and out.attempts == 1 and "cannot confirm the load" in (out.error or "")


def test_vllm_error_bodies_as_0_11_and_later_send_them(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    c = cfg({"kind": "vllm", "name": "v", "base_url": srv.url, "retries": 2})
    gone = adapter(tmp_path, 4)
    gone.path.joinpath("adapter_config.json").unlink()
    gone.path.rmdir()
    [out] = notify_all(c, gone, sleep=Sleeps())
    assert not out.ok and "No adapter found for" in (out.error or "")  # read from {"error": {"message"}}
    [ok] = notify_all(c, adapter(tmp_path, 5), sleep=Sleeps())
    assert ok.ok and ok.detail["confirmed_by"] == "/v1/models"


# -- failures, retries, timeouts --------------------------------------------------------------
def test_retries_with_exponential_backoff(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "fail", status=503)
    sleeps = Sleeps()
    c = cfg({"kind": "vllm", "name": "down", "base_url": srv.url, "retries": 3, "backoff_s": 0.5})
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=sleeps)
    assert not out.ok and out.attempts == 4 and sleeps == [0.5, 1.0, 2.0]
    assert "HTTP 503" in (out.error or "") and "engine is sleeping" in (out.error or "")
    assert len(srv.requests) == 4  # one GET /v1/models per attempt (a failing server is asked before the load)


def test_backoff_is_capped(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "fail")
    sleeps = Sleeps()
    c = cfg({"kind": "webhook", "name": "w", "url": srv.url, "retries": 4, "backoff_s": 20})
    assert notify_all(c, adapter(tmp_path, 1), sleep=sleeps)[0].attempts == 5
    assert sleeps == [20, 40, 60, 60]


def test_timeout_is_reported_and_retried(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "hang")
    sleeps = Sleeps()
    c = cfg({"kind": "vllm", "name": "slow", "base_url": srv.url, "timeout_s": 0.2, "retries": 1})
    t0 = time.monotonic()
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=sleeps)
    assert not out.ok and out.attempts == 2 and sleeps == [1.0]
    assert "timed out after 0.2 s" in (out.error or "")
    # cut at 0.2 s twice, not answered by the server's hang (5 s each): a bound no busy box reaches by load alone
    assert time.monotonic() - t0 < 10 and 0.3 < out.seconds < 10


def test_connection_refused_is_retried(tmp_path: Path, servers: list[Fake]) -> None:
    srv = start(servers, "vllm")
    url = srv.url
    srv.close()
    servers.remove(srv)
    c = cfg({"kind": "sglang", "name": "gone", "base_url": url, "retries": 2, "backoff_s": 0.1})
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=(sleeps := Sleeps()))
    assert not out.ok and out.attempts == 3 and sleeps == [0.1, 0.2]


def test_one_failing_target_does_not_stop_the_others(tmp_path: Path, servers: list[Fake]) -> None:
    bad, good, hook = start(servers, "fail"), start(servers, "vllm"), start(servers, "webhook")
    newest = tmp_path / "run" / "newest"
    c = cfg(
        {"kind": "vllm", "name": "bad", "base_url": bad.url, "retries": 1},
        {"kind": "vllm", "name": "good", "base_url": good.url},
        {"kind": "webhook", "name": "hook", "url": hook.url},
        {"kind": "command", "name": "cmd", "argv": [sys.executable, "-c", "pass"]},
        newest_name_file=str(newest),
    )
    outs = notify_all(c, adapter(tmp_path, 1), sleep=Sleeps())
    assert [(o.target, o.ok) for o in outs] == [("bad", False), ("good", True), ("hook", True), ("cmd", True)]
    assert not newest.exists()  # a server lacks v1: clients must keep using the old name
    json.dumps([o.model_dump(mode='json') for o in outs])  # JSON-ready for the ledger / child events
    ok_only = cfg(*[t.model_dump() for t in c.targets[1:]], newest_name_file=str(newest))
    assert all(o.ok for o in notify_all(ok_only, adapter(tmp_path, 2), sleep=Sleeps()))
    assert newest.read_text() == sn(2) + "\n"


def test_redirects_are_refused(tmp_path: Path, servers: list[Fake]) -> None:
    elsewhere = start(servers, "webhook")
    srv = start(servers, "redirect", redirect_to=elsewhere.url + "/steal")
    [out] = notify_all(cfg({"kind": "webhook", "name": "w", "url": srv.url}), adapter(tmp_path, 1), sleep=Sleeps())
    assert not out.ok and out.attempts == 1 and "HTTP 302" in (out.error or "")
    assert elsewhere.requests == []  # only URLs from the configuration are contacted


# -- webhook ---------------------------------------------------------------------------------
def test_webhook_is_signed_and_carries_the_bearer_token(
    tmp_path: Path,
    servers: list[Fake],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = start(servers, "webhook", api_key="tok-1", secret="hmac-key")
    monkeypatch.setenv("HOOK_TOKEN", "tok-1")
    secret_file = tmp_path / "hmac"
    secret_file.write_text("hmac-key\n")
    secret_file.chmod(0o600)
    c = cfg(
        {
            "kind": "webhook",
            "name": "w",
            "url": srv.url + "/hook",
            "token_env": "HOOK_TOKEN",
            "hmac_secret_file": str(secret_file),
        }
    )
    a = adapter(tmp_path, 7)
    [out] = notify_all(c, a, sleep=Sleeps())
    assert out.ok and out.detail["status"] == 204 and out.detail["signed"], out
    [req] = srv.requests
    payload = json.loads(req["raw"])
    assert payload == {
        "event": "promoted",
        "text": "nightshift: tiny-v0007 is now in service",
        "version": 7,
        "name": "tiny-v0007",
        "served_name": sn(7),
        "path": str(a.path),
        "base_model": BASE,
        "manifest": a.manifest,
        "method": "qlora",
    }
    headers = req["headers"]
    assert verify_signature("hmac-key", req["raw"], headers, now=time.time())
    tampered = req["raw"].replace(b'"version":7', b'"version":8')
    assert not verify_signature("hmac-key", tampered, headers, now=time.time())
    assert not verify_signature("other-key", req["raw"], headers, now=time.time())
    assert not verify_signature("hmac-key", req["raw"], headers, now=time.time() + 3600)  # replayed late
    # the receiver itself refuses a tampered body sent with the original headers
    import urllib.error
    import urllib.request

    fwd = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(srv.url, data=tampered, headers=fwd), timeout=5)
    assert e.value.code == 401


def test_webhook_wrong_token_and_missing_secret_fail_without_retry(
    tmp_path: Path,
    servers: list[Fake],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = start(servers, "webhook", api_key="right")
    monkeypatch.setenv("HOOK_TOKEN", "wrong")
    c = cfg(
        {"kind": "webhook", "name": "w", "url": srv.url, "token_env": "HOOK_TOKEN", "retries": 3},
        {"kind": "webhook", "name": "w2", "url": srv.url, "hmac_secret_file": str(tmp_path / "nope")},
    )
    sleeps = Sleeps()
    bad_token, no_secret = notify_all(c, adapter(tmp_path, 1), sleep=sleeps)
    assert not bad_token.ok and bad_token.attempts == 1 and "HTTP 401" in (bad_token.error or "")
    assert not no_secret.ok and "cannot read" in (no_secret.error or "") and sleeps == []
    assert len(srv.requests) == 1  # no request at all without its secret


# -- command ---------------------------------------------------------------------------------
def test_command_gets_the_path(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"
    script = (
        "import json, os, sys; json.dump({'argv': sys.argv[1:], "
        "'name': os.environ['NIGHTSHIFT_ADAPTER_NAME']}, open(sys.argv[1], 'w')); print('reloaded')"
    )
    c = cfg({"kind": "command", "name": "c", "argv": [sys.executable, "-c", script, str(seen)]})
    a = adapter(tmp_path, 3)
    [out] = notify_all(c, a, sleep=Sleeps())
    assert out.ok and out.detail["returncode"] == 0 and "reloaded" in out.detail["output_tail"]
    assert json.loads(seen.read_text()) == {"argv": [str(seen), str(a.path)], "name": "tiny-v0003"}


def test_command_failure_keeps_the_output_tail(tmp_path: Path) -> None:
    c = cfg(
        {
            "kind": "command",
            "name": "c",
            "retries": 1,
            "argv": [sys.executable, "-c", "import sys; print('x' * 5000 + 'server said no'); sys.exit(3)"],
        }
    )
    sleeps = Sleeps()
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=sleeps)
    assert not out.ok and out.attempts == 2 and sleeps == [1.0]
    assert "status 3" in (out.error or "") and out.detail["output_tail"].endswith("server said no\n")
    assert len(out.detail["output_tail"]) == 2000
    [missing] = notify_all(
        cfg({"kind": "command", "name": "m", "argv": [str(tmp_path / "nope")]}), adapter(tmp_path, 1), sleep=sleeps
    )
    assert not missing.ok and missing.attempts == 1 and "cannot run" in (missing.error or "")


def test_command_timeout_kills_it_and_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); print('started', flush=True); "
        "time.sleep(60)"
    )
    c = cfg({"kind": "command", "name": "c", "timeout_s": 1.0, "retries": 0, "argv": [sys.executable, "-c", script]})
    t0 = time.monotonic()
    [out] = notify_all(c, adapter(tmp_path, 1), sleep=Sleeps())
    assert time.monotonic() - t0 < 50  # killed at 1 s, not waited for (60 s)
    assert not out.ok and "timed out after 1 s and was killed" in (out.error or "")
    assert "started" in out.detail["output_tail"]
    for pid in map(int, pids.read_text().split()):
        end = time.monotonic() + hang_bound(10)
        while not dead(pid):  # killed: a zombie until whoever inherits it reaps it (on a busy box, later)
            assert time.monotonic() < end, f"process {pid} survived the timeout"
            time.sleep(0.05)


def dead(pid: int) -> bool:
    """Gone, or killed and not reaped yet (state Z: `kill -0` still finds a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


# -- TLS -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509", reason="cryptography is needed to make a test certificate")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return d / "cert.pem", d / "key.pem"


def test_tls_self_signed_is_refused_by_default(
    tmp_path: Path,
    servers: list[Fake],
    self_signed: tuple[Path, Path],
) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*self_signed)
    srv = start(servers, "vllm", tls=ctx)
    a = adapter(tmp_path, 1)
    sleeps = Sleeps()
    [out] = notify_all(cfg({"kind": "vllm", "name": "t", "base_url": srv.url, "retries": 3}), a, sleep=sleeps)
    assert not out.ok and out.attempts == 1 and sleeps == []  # a certificate problem is not retried
    assert "certificate verification failed" in (out.error or "") and "ca_bundle" in (out.error or "")
    assert srv.loaded == {}
    trusted = cfg({"kind": "vllm", "name": "t", "base_url": srv.url, "ca_bundle": str(self_signed[0])})
    assert notify_all(trusted, a, sleep=sleeps)[0].ok
    lab = cfg({"kind": "vllm", "name": "t", "base_url": srv.url, "verify_tls": False})
    [out] = notify_all(lab, adapter(tmp_path, 2), sleep=sleeps)
    assert out.ok and set(srv.loaded) == {sn(1), sn(2)}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_name_held_from_other_files_is_unloaded_and_loaded_again(tmp_path: Path, servers: list[Fake],
                                                                   kind: str) -> None:
    """Another state directory, a restored backup: the server holds our served name from elsewhere. The
    old code called it a re-send ("already loaded", ok) and the server kept answering with other weights."""
    srv = start(servers, kind)
    a = adapter(tmp_path, 1)
    srv.loaded[a.served_name] = "/elsewhere/tiny-v0001"
    [out] = notify_all(cfg({"kind": kind, "name": "s", "base_url": srv.url}), a, sleep=Sleeps())
    assert out.ok and out.detail["replaced_stale"] == "/elsewhere/tiny-v0001" and not out.detail["already_loaded"]
    assert srv.loaded == {a.served_name: str(a.path)}
    unload = "/v1/unload_lora_adapter" if kind == "vllm" else "/unload_lora_adapter"
    assert [r["body"]["lora_name"] for r in srv.posts(unload)] == [a.served_name]


def test_served_names_differ_for_other_files_under_one_version(tmp_path: Path) -> None:
    a = adapter(tmp_path / "a", 1)
    b = AdapterRef(version=1, name="tiny-v0001", path=a.path, base_model=BASE,
                   manifest={"files": {"adapter_config.json": "cd" * 32}})
    assert a.name == b.name and a.served_name != b.served_name
    assert parse_version_name(a.served_name) is None  # not a version name: never published under it
