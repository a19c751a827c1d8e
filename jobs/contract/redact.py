"""Secrets in URLs: one redaction for every log line, ledger row, printed config and report.

A webhook URL often carries its own secret (a path token, `?token=`, `user:password@`). What stays
readable is what tells an operator which server it is: the scheme, the host and the port, and the
path segments nightshift itself appends to a server's base URL (`/v1/load_lora_adapter`). Every other
path segment, every query value, the fragment and any user-info become `***`.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

MASK = "***"
# The endpoints the hot-swap code appends to a base URL (jobs/hotswap): names, never secrets.
KNOWN_SEGMENTS = frozenset({"", "v1", "load_lora_adapter", "unload_lora_adapter", "models",
                            "update_weights_from_disk", "health", "metrics"})
# A URL inside any text: up to a quote, whitespace, a bracket or a backslash (JSON escapes).
_SENTENCE_END = ":;,.!?)"
_URL = re.compile(r"""\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s"'<>\\`{}|^\[\]]+""")


def redact_url(url: str) -> str:
    """The URL with every part that is not the scheme, host, port or a known endpoint name masked."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # not parseable: nothing of it after the scheme is shown
        return url.split("://", 1)[0] + "://" + MASK
    host = parts.hostname or ""
    netloc = (f"{MASK}@" if "@" in parts.netloc else "") + (f"[{host}]" if ":" in host else host)
    netloc += f":{port}" if port is not None else ""
    path = "/".join(seg if seg in KNOWN_SEGMENTS else MASK for seg in parts.path.split("/"))
    out = f"{parts.scheme}://{netloc}{path}"
    if parts.query:
        out += "?" + "&".join(f"{kv.partition('=')[0]}={MASK}" if "=" in kv else MASK
                              for kv in parts.query.split("&"))
    if parts.fragment:
        out += "#" + MASK
    return out


def redact_text(text: str) -> str:
    """Every URL in `text` redacted (the rest unchanged; safe inside JSON text). Punctuation that ends a URL's
    sentence (`GET http://h:8000/v1/models: Connection refused`) is the sentence's, not a path segment's: it was
    masked with the endpoint name before it (`/v1/*** Connection refused`)."""
    def one(m: re.Match[str]) -> str:
        url = m.group(0).rstrip(_SENTENCE_END)
        return redact_url(url) + m.group(0)[len(url):]

    return _URL.sub(one, text) if "://" in text else text


def redact_value(value: Any) -> Any:
    """Strings, and the strings inside lists and dicts (a log event, a printed config), redacted."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(v) for v in value)
    return value


def redact_log_event(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: the last one before rendering, so no log line carries a URL's secrets."""
    return {k: redact_value(v) for k, v in event.items()}
