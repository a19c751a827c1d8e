"""[hotswap]: where a newly promoted adapter is announced.

```toml
[hotswap]
newest_name_file = "/var/lib/nightshift/newest-adapter"   # optional; clients read the name here

[[hotswap.targets]]
kind = "vllm"                     # vllm | sglang | webhook | command
name = "vllm-local"
base_url = "http://127.0.0.1:8000"
keep_loaded = 2                   # our versions left loaded after a swap (grace for in-flight clients)
api_key_file = "/etc/nightshift/vllm-api-key"   # optional, sent as Authorization: Bearer

[[hotswap.targets]]
kind = "webhook"
name = "deployer"
url = "https://deploy.internal/hooks/adapter"
token_env = "NIGHTSHIFT_DEPLOY_TOKEN"           # Bearer token: token_file or token_env, never `token`
hmac_secret_file = "/etc/nightshift/webhook-hmac"

[[hotswap.targets]]
kind = "command"
name = "reload-script"
argv = ["/usr/local/bin/reload-adapter", "--quiet"]   # the adapter's path is appended
timeout_s = 120
```

Secrets are never written in clear in the TOML: a `token`, `api_key` or `hmac_secret` key
is refused with a message naming the `_file` / `_env` alternatives. Secret files and
variables are read at send time, so rotating them needs no restart.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.32.0)
_CLEAR_SECRETS = {
    "token": "token",
    "api_key": "api_key",
    "hmac_secret": "hmac_secret",
    "secret": "hmac_secret",
    "password": "token",
    "bearer": "token",
}


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials (user:password@); use the *_file / *_env options")
    return url


class _Target(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    # One deadline for a whole attempt: every HTTP exchange of it (connect, send, the whole answer) or
    # the whole command run. A swap takes at most (retries + 1) * timeout_s plus the backoffs.
    timeout_s: float = Field(30.0, gt=0)
    retries: int = Field(2, ge=0)  # attempts after the first one, for transient failures only
    backoff_s: float = Field(1.0, ge=0)  # wait before retry 1; doubles each retry (capped at 60 s)

    @model_validator(mode="before")
    @classmethod
    def _no_clear_text_secret(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, base in _CLEAR_SECRETS.items():
                if key in data:
                    raise ValueError(
                        f"'{key}' must not be written in clear in the configuration: use "
                        f"'{base}_file' (path of a file readable only by the daemon's user) or "
                        f"'{base}_env' (name of an environment variable holding it)"
                    )
        return data

    @staticmethod
    def _one_of(file: Path | None, env: str | None, what: str) -> None:
        if file is not None and env is not None:
            raise ValueError(f"give {what}_file or {what}_env, not both")


class _HttpTarget(_Target):
    verify_tls: bool = True  # off only for a lab; logged as a warning at every send
    ca_bundle: Path | None = None  # PEM file of the CA(s) that signed the server's certificate
    max_body_bytes: int = Field(1 << 20, ge=1024)  # an answer is read up to this many bytes, the rest dropped


class LoraServerTarget(_HttpTarget):
    """An inference server with runtime LoRA loading (vLLM or SGLang)."""

    kind: Literal["vllm", "sglang"]
    base_url: str
    keep_loaded: int = Field(2, ge=1)  # our versions left loaded, the one just loaded included
    api_key_file: Path | None = None
    api_key_env: str | None = None
    # The adapters directory as the server sees it (server in a container): the path sent
    # becomes <remote_adapters_dir>/<version directory name>. Unset: the local absolute path.
    remote_adapters_dir: str | None = None
    # A full fine-tuned version (a whole model, not a LoRA adapter): "reload" replaces the served
    # model's weights from its directory (SGLang's /update_weights_from_disk); "refuse" reports it
    # as not sent. Unset: sglang reloads, vllm refuses (it has no production full-weight reload).
    full_versions: Literal["reload", "refuse"] | None = None
    reload_timeout_s: float = Field(600.0, gt=0)  # reading a whole model from disk takes minutes
    # What the server was started with, checked before every load (jobs.hotswap.preflight). vLLM does
    # not say it over HTTP: give its --max-lora-rank here (vLLM's default 16). SGLang says it
    # (/get_server_info), and its answer wins over these.
    max_lora_rank: int = Field(16, ge=1)
    lora_target_modules: list[str] | None = None  # SGLang's --lora-target-modules; unset: not checked
    expert_lora: bool = False  # the server runs LoRA on MoE experts (vLLM's FusedMoE-LoRA); off: refused

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        return _check_url(v).rstrip("/")

    @model_validator(mode="after")
    def _secrets(self) -> LoraServerTarget:
        self._one_of(self.api_key_file, self.api_key_env, "api_key")
        if self.kind == "vllm" and self.max_lora_rank not in _VLLM_RANKS:
            raise ValueError(f"max_lora_rank = {self.max_lora_rank}: vLLM's --max-lora-rank is one of "
                             f"{', '.join(map(str, _VLLM_RANKS))}")
        if self.kind == "vllm" and self.full_versions == "reload":
            raise ValueError('full_versions = "reload": vLLM has no production API to reload a whole model '
                             "(its reload_weights needs VLLM_SERVER_DEV_MODE); use a command or webhook target")
        return self

    @property
    def reloads_full_versions(self) -> bool:
        return self.kind == "sglang" and self.full_versions != "refuse"

    def api_key(self) -> str | None:
        return read_secret(self.api_key_file, self.api_key_env, f"{self.name}: api_key")


NightEvent = Literal["promoted", "rejected", "failed", "skipped", "backlog_growing"]


class WebhookTarget(_HttpTarget):
    """POST of {event, text, version, name, path, base_model, manifest} on a promotion, and of
    {event, text, night, ...} on the other events it subscribes to; signed (see jobs.hotswap.webhook)."""

    kind: Literal["webhook"]
    url: str
    # promoted: a version went into service (a night, `adapters promote` or `rollback`); rejected: the
    # gate kept the candidate out; failed / skipped: a night closed so; backlog_growing: three nights in a row
    events: list[NightEvent] = Field(default_factory=lambda: ["promoted"])
    payload: Literal["nightshift", "slack"] = "nightshift"  # slack: {"text": ...} only (Slack-compatible hooks)
    token_file: Path | None = None
    token_env: str | None = None
    hmac_secret_file: Path | None = None
    hmac_secret_env: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)

    @model_validator(mode="after")
    def _secrets(self) -> WebhookTarget:
        self._one_of(self.token_file, self.token_env, "token")
        self._one_of(self.hmac_secret_file, self.hmac_secret_env, "hmac_secret")
        return self

    def token(self) -> str | None:
        return read_secret(self.token_file, self.token_env, f"{self.name}: token")

    def hmac_secret(self) -> str | None:
        return read_secret(self.hmac_secret_file, self.hmac_secret_env, f"{self.name}: hmac_secret")


class CommandTarget(_Target):
    """argv + [adapter path], run without a shell; exit 0 = success."""

    kind: Literal["command"]
    argv: list[str] = Field(min_length=1)


Target = Annotated[LoraServerTarget | WebhookTarget | CommandTarget, Field(discriminator="kind")]


class ShadowConfig(BaseModel):
    """[hotswap.shadow]: the candidate through the server before promotion (jobs.hotswap.shadow).

    Loaded under a shadow name, the gate's probe prompts answered greedily by the server and by the
    candidate in process; the gate fails where more than `max_disagreement` of them differ in their
    first `max_new_tokens` tokens. Same dtype and weights (a LoRA on an unquantised base, float32 or
    bf16 on both sides) agree token for token; a QLoRA candidate (4-bit base in process, 16-bit in the
    server) may not: give such a setup a tolerance."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    target: str | None = None  # the vllm/sglang target to ask (default: the first one)
    samples: int = Field(8, ge=1)  # probe prompts, from the held-out then the regression set
    max_new_tokens: int = Field(8, ge=1)
    max_disagreement: float = Field(0.0, ge=0.0, le=1.0)  # share of probes allowed to differ


class HotswapConfig(BaseModel):
    """[hotswap]: the targets, notified one after the other after a promotion or a rollback."""

    model_config = ConfigDict(extra="forbid")
    targets: list[Target] = Field(default_factory=list)
    shadow: ShadowConfig = Field(default_factory=ShadowConfig)
    # Written (atomically) with the served name, e.g. `tiny-v0007\n`, once every vllm/sglang
    # target has it loaded: clients pick the newest name here (or from the metric / webhook),
    # never by "highest version listed" (after a rollback that one is the bad one).
    newest_name_file: Path | None = None

    @field_validator("targets")
    @classmethod
    def _unique_names(cls, targets: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for t in targets:
            if t.name in seen:
                raise ValueError(f"two targets are named {t.name!r}; names label metrics and must be unique")
            seen.add(t.name)
        return targets

    @model_validator(mode="after")
    def _shadow_target(self) -> HotswapConfig:
        if self.shadow.enabled and self.shadow_target() is None:
            which = f"named {self.shadow.target!r}" if self.shadow.target else "at all"
            raise ValueError(f"[hotswap.shadow] enabled, but no vllm or sglang target {which} to load the candidate in")
        return self

    def shadow_target(self) -> LoraServerTarget | None:
        servers = [t for t in self.targets if isinstance(t, LoraServerTarget)]
        if self.shadow.target is not None:
            servers = [t for t in servers if t.name == self.shadow.target]
        return servers[0] if servers else None


class SecretError(Exception):
    """A configured secret cannot be read (permanent: retrying will not help)."""


def read_secret(file: Path | None, env: str | None, what: str) -> str | None:
    """The secret from its file (stripped) or environment variable; None when not configured."""
    if file is not None:
        try:
            mode = file.stat().st_mode
            value = file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SecretError(f"{what}: cannot read {file}: {e.strerror or e}") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            structlog.get_logger("nightshift.hotswap").warning(
                "hotswap.secret_file_open", file=str(file), hint="chmod 600: readable by others"
            )
    elif env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise SecretError(f"{what}: environment variable {env} is not set or empty")
    else:
        return None
    if not value:
        raise SecretError(f"{what}: {file} is empty")
    return value
