"""A small HTTP client on the standard library (no new dependency), locked down on purpose.

- Only the configured URL is contacted: redirects are refused (a 3xx is a failure) and the
  environment's proxy variables are ignored.
- TLS is verified by default (system CA store, or the target's ca_bundle); a verification
  failure is permanent (not retried) and says how to fix it.
- `timeout_s` bounds each socket operation (connect, each read), as urllib does.
Non-2xx answers are returned, not raised: the caller knows what a 400 or 404 means for it.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.hotswap.core import TargetError

USER_AGENT = "nightshift-hotswap/1"


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
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
        return self.body.decode("utf-8", "replace").strip()[:limit]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None  # urllib then raises HTTPError(3xx), returned below as a failed Response


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


def request(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float,
    ctx: ssl.SSLContext,
) -> Response:
    """One HTTP exchange. Raises TargetError for transport failures (retryable unless TLS)."""
    hdrs = {"User-Agent": USER_AGENT, "Accept": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=body, headers=hdrs, method=method)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx), _NoRedirect()
    )
    try:
        with opener.open(req, timeout=timeout_s) as r:
            return Response(r.status, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Response(e.code, e.read() or b"")
    except TimeoutError as e:
        raise TargetError(f"{method} {url}: timed out after {timeout_s:g} s", retryable=True) from e
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ssl.SSLCertVerificationError | ssl.CertificateError):
            raise TargetError(
                f"{method} {url}: TLS certificate verification failed ({reason}); give the CA "
                "in ca_bundle (verify_tls = false only for a lab)",
                retryable=False,
            ) from e
        if isinstance(reason, TimeoutError | socket.timeout):
            raise TargetError(f"{method} {url}: timed out after {timeout_s:g} s", retryable=True) from e
        raise TargetError(f"{method} {url}: {reason}", retryable=True) from e
    except ssl.SSLError as e:
        raise TargetError(f"{method} {url}: TLS error: {e}", retryable=False) from e
    except (OSError, http.client.HTTPException) as e:  # reset mid-answer, bad status line...
        raise TargetError(f"{method} {url}: {type(e).__name__}: {e}", retryable=True) from e


def post_json(url: str, payload: Any, **kw: Any) -> Response:
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return request("POST", url, body=json.dumps(payload).encode(), headers=headers, **kw)
