"""A small HTTP client on the standard library (no new dependency), locked down on purpose.

- Only the configured URL is contacted: there is no redirect handling (a 3xx is a failure) and
  no proxy (the environment's proxy variables are never read).
- TLS is verified by default (system CA store, or the target's ca_bundle); a verification
  failure is permanent (not retried) and says how to fix it.
- `timeout_s` is ONE deadline for the whole exchange: connect, send, status line, headers and
  the whole body. A server that trickles its answer (a byte every 2 s) is cut at the deadline,
  not kept alive read after read: a watchdog shuts the socket down when the deadline passes.
- At most `max_body` bytes of an answer are read (the rest is dropped and the connection
  closed): a 500 with a 2 GiB body costs `max_body` of memory, not 2 GiB.
Non-2xx answers are returned, not raised: the caller knows what a 400 or 404 means for it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jobs.hotswap.core import TargetError

USER_AGENT = "nightshift-hotswap/1"
MAX_BODY_BYTES = 1 << 20  # 1 MiB: every answer we need (a model list, an error) is far smaller
_CHUNK = 65536


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    truncated: bool = False  # the answer was longer than max_body: body holds its first bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        if self.truncated:
            return None
        try:
            return json.loads(self.body or b"null")
        except ValueError:
            return None

    def message(self, limit: int = 300) -> str:
        """The server's error text: vLLM {"message"} / {"error": {"message"}}, SGLang
        {"error_message"}, FastAPI {"detail"}, else the raw body."""
        data = self.json()
        if isinstance(data, dict):
            err = data.get("error")
            for v in (
                err.get("message") if isinstance(err, dict) else err,
                data.get("message"),
                data.get("error_message"),
                data.get("detail"),
            ):
                if v:
                    return str(v)[:limit]
        text = self.body[: limit * 4].decode("utf-8", "replace").strip()[:limit]
        return text + (" [answer cut at the size limit]" if self.truncated else "")


def tls_context(verify: bool, ca_bundle: Path | None) -> ssl.SSLContext:
    if not verify:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)


def retryable_status(status: int) -> bool:
    """5xx, 429 and 408 may pass on their own; other 4xx/3xx will not."""
    return status >= 500 or status in (408, 429)


class _Watchdog:
    """Shuts the connection's socket down at the deadline, whatever call is blocked on it."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn, self.fired = conn, threading.Event()
        self.timer = threading.Timer(max(seconds, 0.0), self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Watchdog:
        self.timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.timer.cancel()


def _connection(url: str, timeout_s: float, ctx: ssl.SSLContext) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout_s, context=ctx), path
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s), path


def _read_capped(r: http.client.HTTPResponse, max_body: int, deadline: float) -> tuple[bytes, bool]:
    buf = bytearray()
    while len(buf) <= max_body:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = r.read1(min(_CHUNK, max_body + 1 - len(buf)))
        if not chunk:
            return bytes(buf), False
        buf += chunk
    return bytes(buf[:max_body]), True


def request(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float,
    ctx: ssl.SSLContext,
    max_body: int = MAX_BODY_BYTES,
    deadline: float | None = None,
) -> Response:
    """One HTTP exchange, all of it within `timeout_s` and before `deadline` (time.monotonic(): the end
    of the attempt this exchange belongs to). Raises TargetError for transport failures (retryable
    unless TLS)."""
    hdrs = {"User-Agent": USER_AGENT, "Accept": "application/json", "Connection": "close", **(headers or {})}
    now = time.monotonic()
    deadline = min(now + timeout_s, deadline if deadline is not None else float("inf"))
    if deadline <= now:
        raise TargetError(f"{method} {url}: not sent, the attempt's {timeout_s:g} s are spent", retryable=True)
    conn, path = _connection(url, deadline - now, ctx)
    watchdog = _Watchdog(conn, deadline - now)
    timed_out = TargetError(f"{method} {url}: timed out after {timeout_s:g} s (the whole exchange)", retryable=True)
    try:
        with watchdog:
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            data, truncated = _read_capped(r, max_body, deadline)
        if watchdog.fired.is_set():  # the shutdown may read as an early end of the answer
            raise timed_out
        return Response(r.status, data, truncated)
    except ssl.SSLCertVerificationError as e:
        raise TargetError(
            f"{method} {url}: TLS certificate verification failed ({e}); give the CA "
            "in ca_bundle (verify_tls = false only for a lab)",
            retryable=False,
        ) from e
    except ssl.SSLError as e:
        if watchdog.fired.is_set():
            raise timed_out from e
        raise TargetError(f"{method} {url}: TLS error: {e}", retryable=False) from e
    except TimeoutError as e:
        raise timed_out from e
    except (OSError, http.client.HTTPException) as e:  # refused, reset mid-answer, bad status line...
        if watchdog.fired.is_set():
            raise timed_out from e
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise TargetError(f"{method} {url}: {reason}", retryable=True) from e
    finally:
        conn.close()


def post_json(url: str, payload: Any, **kw: Any) -> Response:
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return request("POST", url, body=json.dumps(payload).encode(), headers=headers, **kw)
