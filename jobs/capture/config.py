"""[capture]: where the pass-through listens, what it forwards to, and its bounds (memory, disk, rate)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

REDACTED = "[redacted]"


class CaptureConfig(BaseModel):
    """`nightshift capture`'s settings; every bound has a default so that nothing grows without one."""

    model_config = ConfigDict(extra="forbid")
    upstream: str = Field(description="the inference server's base URL, e.g. http://127.0.0.1:8000")
    inbox: Path = Field(description="where feedback records land (a [[sources]] inbox the night pulls)")
    state: Path = Field(description="the capture journal's directory (prompts and replies awaiting feedback)")
    host: str = Field("127.0.0.1", description="listen address: loopback unless the operator says otherwise")
    port: int = Field(8100, ge=0, le=65535)
    redact: list[str] = Field(default_factory=list, description="regexes; every match is replaced by "
                              f"{REDACTED!r} in prompts, replies and edits before anything is written")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="a request or reply larger is forwarded, not captured")
    max_captures: int = Field(10_000, ge=1, description="replies held in memory for feedback (the oldest go first)")
    max_journal_bytes: int = Field(256 << 20, ge=4096, description="the capture journal's size before it is rotated "
                                   "(one older generation kept: at most twice this on disk)")
    max_inbox_bytes: int = Field(1 << 30, ge=4096, description="feedback files written and not yet pulled; over it, "
                                 "feedback is refused (HTTP 507) rather than acknowledged")
    captures_per_second: float = Field(50.0, gt=0, description="over it, requests are forwarded but not captured")
    feedback_per_second: float = Field(20.0, gt=0, description="over it, feedback is refused (HTTP 429)")
    queue: int = Field(1000, ge=1, description="captures waiting to be written (full: dropped, counted)")
    upstream_timeout_seconds: float = Field(600.0, gt=0)

    @field_validator("redact")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for i, pattern in enumerate(v):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"redact[{i}] {pattern!r} is not a regular expression: {e}") from None
        return v

    @field_validator("upstream")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream {v!r} must be an http:// or https:// URL")
        return v.rstrip("/")


class Redactor:
    """The operator's rules applied to every string of a value (prompts, replies, edits)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = [re.compile(p) for p in patterns]

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            for p in self.patterns:
                value = p.sub(REDACTED, value)
            return value
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value
