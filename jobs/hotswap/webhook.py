"""Generic webhook: POST the new version as JSON, authenticated and signed.

Body (UTF-8 JSON, keys sorted, no spaces): {"base_model", "event", "manifest", "method", "name", "served_name", "path",
"text", "version"} for a promotion (`method` "full": `path` is a whole model directory, safetensors
shards and tokenizer, else a LoRA adapter), the manifest without its "config", so no receiver learns
the other targets' URLs or where secrets live; other events (jobs.hotswap.events) send {"event", "text", "night", ...};
`payload = "slack"` sends {"text"} only, which Slack-compatible incoming webhooks accept.
Headers:
- Authorization: Bearer <token>            when token_file / token_env is set
- X-Nightshift-Timestamp: <unix seconds>   when the request was signed (fresh per attempt)
- X-Nightshift-Signature: sha256=<hex>     HMAC-SHA256(secret, f"{timestamp}." + body bytes)
- X-Nightshift-Delivery: <uuid4>           the same for every retry of one notification

Why the timestamp is inside the signed material: a captured request cannot be replayed
later with a new timestamp, and a receiver rejects timestamps older than a few minutes
(`verify_signature(..., tolerance_s=300)`); the delivery id lets it drop duplicates
inside that window. A receiver must compute the HMAC over the raw body bytes it received,
before any JSON parsing, and compare in constant time (as verify_signature does).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from jobs.hotswap.config import SecretError, WebhookTarget
from jobs.hotswap.core import AdapterRef, Clock, HotswapOutcome, Sleep, TargetError, with_retries
from jobs.hotswap.transport import request, retryable_status, tls_context

SIGNATURE_HEADER = "X-Nightshift-Signature"
TIMESTAMP_HEADER = "X-Nightshift-Timestamp"
DELIVERY_HEADER = "X-Nightshift-Delivery"


def body_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8")


def payload_bytes(adapter: AdapterRef, style: str = "nightshift") -> bytes:
    """The version, not the config: a receiver never learns the other targets (URLs, secrets' places)."""
    text = f"nightshift: {adapter.name} is now in service"
    if style == "slack":
        return body_bytes({"text": text})
    return body_bytes({
        "event": "promoted",
        "text": text,
        "version": adapter.version,
        "name": adapter.name,
        "served_name": adapter.served_name,  # the name a LoRA server holds it under (jobs.hotswap.core)
        "path": str(adapter.path),
        "base_model": adapter.base_model,
        "manifest": {k: v for k, v in adapter.manifest.items() if k != "config"},
        "method": adapter.method.value,  # full: `path` is a whole model directory
    })


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify_signature(
    secret: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float,
    tolerance_s: float = 300,
) -> bool:
    """For receivers (and our tests): signature valid and timestamp within ±tolerance_s."""
    low = {k.lower(): v for k, v in headers.items()}
    try:
        ts = int(low[TIMESTAMP_HEADER.lower()])
        given = low[SIGNATURE_HEADER.lower()]
    except (KeyError, ValueError):
        return False
    if abs(now - ts) > tolerance_s:
        return False
    return hmac.compare_digest(given, sign(secret, ts, body))


def notify(
    t: WebhookTarget,
    adapter: AdapterRef,
    *,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any,
    wall: Callable[[], float] = time.time,
) -> HotswapOutcome:
    return post(t, payload_bytes(adapter, t.payload), sleep=sleep, clock=clock, log=log, wall=wall)


def post(
    t: WebhookTarget,
    body: bytes,
    *,
    sleep: Sleep,
    clock: Clock = time.monotonic,
    log: Any,
    wall: Callable[[], float] = time.time,
) -> HotswapOutcome:
    """POST `body`, authenticated and signed, with the target's retries."""
    delivery = str(uuid.uuid4())
    ctx = tls_context(t.verify_tls, t.ca_bundle)
    if not t.verify_tls and t.url.startswith("https:"):
        log.warning("hotswap.tls_unverified", target=t.name, url=t.url)

    def attempt(_: int) -> dict[str, Any]:
        try:
            token, secret = t.token(), t.hmac_secret()
        except SecretError as e:
            raise TargetError(str(e), retryable=False) from e
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: delivery}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if secret:
            ts = int(wall())
            headers[TIMESTAMP_HEADER] = str(ts)
            headers[SIGNATURE_HEADER] = sign(secret, ts, body)
        r = request("POST", t.url, body=body, headers=headers, timeout_s=t.timeout_s, ctx=ctx,
                    max_body=t.max_body_bytes)
        if not r.ok:
            raise TargetError(
                f"POST {t.url}: HTTP {r.status}: {r.message()}",
                retryable=retryable_status(r.status),
                detail={"status": r.status},
            )
        return {"status": r.status, "delivery": delivery, "signed": bool(secret)}

    return with_retries(
        attempt, target=t.name, kind=t.kind, retries=t.retries, backoff_s=t.backoff_s, sleep=sleep, clock=clock, log=log
    )
