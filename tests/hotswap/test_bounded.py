"""Every exchange with a target is bounded: one deadline for the whole answer (not per read), a capped
read of any body, and a deterministic refusal ends at once. Local loopback servers that misbehave."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.hotswap import AdapterRef, HotswapConfig, notify_all, worst_case_seconds
from jobs.hotswap.transport import request, tls_context
from tests.conftest import hang_bound

GUARD_S = 120.0  # bounds the test itself where the code under test would hang (the old code did)


class Misbehaving:
    """A TCP server answering every connection with `answer(conn)` in its own thread."""

    def __init__(self, answer) -> None:  # type: ignore[no-untyped-def]
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer, self.stop, self.sent = answer, threading.Event(), 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the client hung up: what a bounded client does
            conn.recv(65536)
            self.answer(self, conn)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def trickle(srv: Misbehaving, conn: socket.socket) -> None:
    """A byte every 2 s, forever: each read gets something, so a per-read timeout never fires."""
    for b in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000:
        if srv.stop.wait(2.0):
            return
        conn.sendall(bytes([b]))
        srv.sent += 1


def huge_500(srv: Misbehaving, conn: socket.socket) -> None:
    """A 500 with a 2 GiB body, streamed as fast as the client reads."""
    size = 2 << 30
    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                 + f"Content-Length: {size}\r\n\r\n".encode())
    chunk = b"e" * (1 << 20)
    while srv.sent < size and not srv.stop.is_set():
        conn.sendall(chunk)
        srv.sent += len(chunk)


@pytest.fixture()
def misbehaving() -> Iterator[list[Misbehaving]]:
    made: list[Misbehaving] = []
    yield made
    for s in made:
        s.close()


def adapter(tmp_path: Path) -> AdapterRef:
    d = tmp_path / "tiny-v0001"
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"]}')
    return AdapterRef(version=1, name=d.name, path=d, base_model="/m", manifest={"files": {"a": "b" * 64}})


def guarded(fn):  # type: ignore[no-untyped-def]
    """fn() in a thread; (its result, seconds) or a failure where it runs past GUARD_S."""
    box: list = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    th.start()
    th.join(GUARD_S)
    assert box, f"still running after {GUARD_S:g} s: not bounded"
    return box[0], time.monotonic() - t0


@pytest.mark.parametrize("kind", ["vllm", "webhook"])
def test_a_trickling_target_is_cut_at_the_attempts_deadline(tmp_path: Path, misbehaving: list, kind: str) -> None:
    srv = Misbehaving(trickle)
    misbehaving.append(srv)
    t = ({"kind": "vllm", "base_url": srv.url} if kind == "vllm" else {"kind": "webhook", "url": srv.url})
    cfg = HotswapConfig.model_validate({"targets": [{**t, "name": "slow", "timeout_s": 5, "retries": 1,
                                                     "backoff_s": 0}]})
    [out], seconds = guarded(lambda: notify_all(cfg, adapter(tmp_path), sleep=lambda _: None))
    assert not out.ok and out.attempts == 2 and "timed out after 5 s" in (out.error or ""), out
    # 2 attempts x 5 s, whatever the trickle (the 100,000 bytes would take 55 h); the rest is a busy box's
    assert seconds <= worst_case_seconds(cfg) + hang_bound(10)
    assert srv.sent < 10  # a few bytes per attempt, not the 100,000 a per-read timeout lets through


def test_a_huge_error_body_is_read_up_to_the_cap(misbehaving: list) -> None:
    srv = Misbehaving(huge_500)
    misbehaving.append(srv)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r, _ = guarded(lambda: request("POST", srv.url, body=b"{}", timeout_s=60, ctx=tls_context(True, None),
                                   max_body=1 << 20))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert r.status == 500 and r.truncated and len(r.body) == 1 << 20
    assert grown_mib < 256, f"peak memory grew by {grown_mib:.0f} MiB reading a 2 GiB answer"
    assert srv.sent < 1 << 30  # the rest was never read: the connection was closed
    assert "answer cut at the size limit" in r.message()


def test_a_deterministic_500_is_not_retried(tmp_path: Path, servers: list) -> None:
    from tests.fixtures.lora_servers import start

    srv = start(servers, "vllm")
    said = ("Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater than "
            "max_lora_rank 8.', please check the stack trace above for the root cause")  # vLLM 0.32.0's words
    srv._load = lambda h, body: srv._error(h, 500, said)  # type: ignore[method-assign]
    cfg = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "v", "base_url": srv.url,
                                                     "retries": 3}]})
    sleeps: list[float] = []
    [out] = notify_all(cfg, adapter(tmp_path), sleep=sleeps.append)
    assert not out.ok and out.attempts == 1 and sleeps == [] and "greater than max_lora_rank" in (out.error or "")


def test_preflight_names_every_misfit_before_any_load(tmp_path: Path, servers: list) -> None:
    from tests.fixtures.lora_servers import start

    srv = start(servers, "vllm")
    a = adapter(tmp_path)
    (a.path / "adapter_config.json").write_text(
        '{"r": 32, "target_modules": ["q_proj", "experts.gate_up_proj"], "use_dora": true}')
    cfg = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "v", "base_url": srv.url,
                                                     "retries": 3, "max_lora_rank": 16}]})
    [out] = notify_all(cfg, a, sleep=lambda _: None)
    assert not out.ok and out.attempts == 1, out
    for words in ("rank 32 > the server's max_lora_rank 16", "--max-lora-rank 32", "MoE experts", "DoRA"):
        assert words in (out.error or "")
    assert srv.posts("/v1/load_lora_adapter") == []
    with pytest.raises(ValueError, match="one of 1, 8, 16"):
        HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "v", "base_url": srv.url,
                                                   "max_lora_rank": 12}]})


def test_a_shadow_check_the_server_cannot_run_says_so_and_passes(tmp_path: Path, servers: list) -> None:
    """A server without the completions route (or down): the check is skipped with the reason, never a lost
    night; the shadow loaded for it is unloaded."""
    from jobs.hotswap import shadow
    from jobs.hotswap.config import ShadowConfig
    from tests.fixtures.lora_servers import start

    srv = start(servers, "vllm")
    cfg = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "v", "base_url": srv.url}],
                                        "shadow": {"enabled": True}})
    sh = ShadowConfig(enabled=True)
    res = shadow.check(cfg.shadow_target(), sh, adapter(tmp_path), [[1, 2, 3]], [[4, 5]])  # type: ignore[arg-type]
    assert res.error is not None and "HTTP 404" in res.error and res.passed(sh) and res.agreement is None
    assert [r["body"]["lora_name"] for r in srv.posts("/v1/unload_lora_adapter")] == [res.name]
    assert srv.loaded == {} and "-shadow-" in res.name
    with pytest.raises(ValueError, match=r"\[hotswap.shadow\] enabled, but no vllm or sglang target"):
        HotswapConfig.model_validate({"targets": [], "shadow": {"enabled": True}})


def test_an_unreadable_adapter_config_is_one_clear_failure(tmp_path: Path, servers: list) -> None:
    from tests.fixtures.lora_servers import start

    srv = start(servers, "vllm")
    a = adapter(tmp_path)
    (a.path / "adapter_config.json").write_text("{not json")
    cfg = HotswapConfig.model_validate({"targets": [{"kind": "vllm", "name": "v", "base_url": srv.url, "retries": 2}]})
    [out] = notify_all(cfg, a, sleep=lambda _: None)
    assert not out.ok and out.attempts == 1 and "adapter_config.json: cannot read the adapter's config" in out.error
