"""`nightshift capture`: the OpenAI-compatible pass-through (stdlib http.server, one thread a connection).

Every request is forwarded as it came (method, path, headers, body) and the upstream's answer is relayed as
it comes, chunk by chunk (streamed replies stay streamed); the reply is never changed. Only after the client
has the whole answer (the connection's write side is shut) is a chat completion parsed and handed to the
store, so capturing never delays the reply beyond the forwarding itself. Over `captures_per_second`, too
large, or not a chat completion: forwarded, not captured, counted.

Endpoints of its own, under /nightshift/: POST feedback, GET metrics (Prometheus), GET health.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import structlog
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from jobs.capture.config import CaptureConfig
from jobs.capture.store import Capture, CaptureStore, Feedback, FeedbackError, served_version

log = structlog.get_logger("nightshift.capture")
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}
CHAT_PATH = "/v1/chat/completions"


class Bucket:
    """A token bucket: `rate` a second, bursts of up to one second's worth (the clock is injected)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens, self.at = max(1.0, rate), clock()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("nightshift_capture_requests", "requests forwarded by the capture path, by what "
                                "was kept of them", ["outcome"], registry=registry)
        self.feedback = Counter("nightshift_capture_feedback", "feedback acknowledged (durable in the inbox), by "
                                "kind", ["kind"], registry=registry)
        self.refused = Counter("nightshift_capture_feedback_refused", "feedback refused, by HTTP status",
                               ["status"], registry=registry)
        self.records = Counter("nightshift_capture_records", "records written to the inbox, by kind (pair, "
                               "supervised, rating: a bad one not paired yet)", ["kind"], registry=registry)


def parse_chat(request: bytes, reply: bytes, content_type: str) -> tuple[list[dict[str, str]], str, str | None,
                                                                       str | None] | None:
    """(conversation, reply text, model, id) of a chat completion, streamed or not; None when it is no
    single-choice text completion of a text conversation."""
    try:
        req = json.loads(request)
        msgs = [{"role": str(m["role"]), "content": m["content"]} for m in req["messages"]]
        if req.get("n", 1) != 1 or not all(isinstance(m["content"], str) for m in msgs):
            return None
        if "text/event-stream" in content_type:
            text, model, rid = [], None, None
            for line in reply.decode("utf-8").splitlines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                ev = json.loads(line[5:])
                model, rid = ev.get("model", model), ev.get("id", rid)
                for ch in ev.get("choices", []):
                    text.append((ch.get("delta") or {}).get("content") or "")
            return msgs, "".join(text), model or req.get("model"), rid
        body = json.loads(reply)
        [choice] = body["choices"]
        content = choice["message"]["content"]
        if not isinstance(content, str):
            return None
        return msgs, content, body.get("model") or req.get("model"), body.get("id")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class CaptureServer:
    def __init__(self, cfg: CaptureConfig, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.metrics = Metrics(registry or CollectorRegistry())
        self.store = CaptureStore(cfg, clock=clock, on_drop=lambda: self.metrics.requests.labels("dropped").inc(),
                                  on_capture=lambda: self.metrics.requests.labels("captured").inc())
        self.capture_rate = Bucket(cfg.captures_per_second, monotonic)
        self.feedback_rate = Bucket(cfg.feedback_per_second, monotonic)
        up = urlsplit(cfg.upstream)
        self.up_https, self.up_host, self.up_port = up.scheme == "https", up.hostname or "127.0.0.1", up.port
        self.up_prefix = up.path.rstrip("/")
        self.httpd = ThreadingHTTPServer((cfg.host, cfg.port), self._handler())
        self.httpd.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[0], self.httpd.server_address[1]  # type: ignore[return-value]

    def serve_forever(self) -> None:
        log.info("capture_listening", host=self.address[0], port=self.address[1], upstream=self.cfg.upstream,
                 inbox=str(self.cfg.inbox), redact_rules=len(self.cfg.redact))
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.store.close()

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.up_https else http.client.HTTPConnection
        return cls(self.up_host, self.up_port, timeout=self.cfg.upstream_timeout_seconds)

    def captured(self, path: str, request: bytes, reply: bytes, status: int, content_type: str,
                 complete: bool) -> None:
        """After the client has its answer: keep it, or count why not."""
        m = self.metrics.requests
        if path.split("?")[0] != CHAT_PATH or status != 200:
            m.labels("not_captured").inc()
            return
        if not complete:
            m.labels("too_large").inc()
            return
        if not self.capture_rate.take():
            m.labels("rate_limited").inc()
            return
        parsed = parse_chat(request, reply, content_type)
        if parsed is None or parsed[3] is None:
            m.labels("not_captured").inc()
            return
        msgs, text, model, rid = parsed
        self.store.add(Capture(id=rid, at=self.clock(), model=model, version=served_version(model),
                               messages=msgs, reply=text))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # structlog, not stderr lines
                pass

            def do_GET(self) -> None:
                if self.path == "/nightshift/metrics":
                    self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
                elif self.path == "/nightshift/health":
                    self._send(200, b'{"ok": true}\n', "application/json")
                else:
                    self._forward()

            def do_POST(self) -> None:
                if self.path == "/nightshift/feedback":
                    self._feedback()
                else:
                    self._forward()

            do_PUT = do_DELETE = do_PATCH = do_POST  # forwarded as they came

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _feedback(self) -> None:
                def refuse(status: int, detail: str) -> None:
                    server.metrics.refused.labels(str(status)).inc()
                    self._send(status, json.dumps({"error": detail}).encode() + b"\n", "application/json")

                n = int(self.headers.get("Content-Length") or 0)
                if n > server.cfg.max_body_bytes:
                    return refuse(413, f"feedback of {n:,} bytes > max_body_bytes {server.cfg.max_body_bytes:,}")
                if not server.feedback_rate.take():
                    return refuse(429, f"over feedback_per_second {server.cfg.feedback_per_second:g}: try again")
                try:
                    fb = Feedback.model_validate_json(self._body() or b"{}")
                    files = server.store.feedback(fb)
                except ValidationError as e:
                    return refuse(422, "; ".join(f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}"
                                                 for x in e.errors()))
                except FeedbackError as e:
                    return refuse(e.status, e.detail)
                server.metrics.feedback.labels(fb.kind).inc()
                for kind, _ in files:
                    server.metrics.records.labels(kind).inc()
                self._send(200, json.dumps({"ok": True, "records": [{"kind": k, "file": f} for k, f in files]})
                           .encode() + b"\n", "application/json")

            def _forward(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                conn = server.connect()
                try:
                    conn.request(self.command, server.up_prefix + self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                except OSError as e:
                    server.metrics.requests.labels("upstream_error").inc()
                    self._send(502, json.dumps({"error": f"upstream {server.cfg.upstream}: {e}"}).encode(),
                               "application/json")
                    conn.close()
                    return
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                kept, complete = bytearray(), True
                # in flight from the reply's first byte: a client that has it all may send feedback on it before
                # this thread gets to capture it (on a busy machine it did, and was told 404), and that waits
                server.store.begin()
                try:
                    try:
                        while chunk := resp.read1(65536):
                            self.wfile.write(chunk)
                            self.wfile.flush()
                            if complete and len(kept) + len(chunk) <= server.cfg.max_body_bytes:
                                kept += chunk
                            else:
                                complete = False
                    finally:
                        conn.close()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_WR)  # the client has all of it: capture after
                    server.captured(self.path, body if len(body) <= server.cfg.max_body_bytes else b"",
                                    bytes(kept), resp.status, resp.getheader("Content-Type") or "",
                                    complete and len(body) <= server.cfg.max_body_bytes)
                finally:
                    server.store.end()

        return Handler


def serve(cfg: CaptureConfig) -> None:
    """Run until SIGINT/SIGTERM (`nightshift capture`)."""
    import signal

    srv = CaptureServer(cfg)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.httpd.shutdown).start())
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.httpd.server_close()
        srv.store.close()
