"""Hot-swap: tell every configured target about a newly promoted (or rolled-back-to) version.

`notify_all(cfg, adapter)` notifies the targets one after the other and returns one
HotswapOutcome per target, in configuration order. A target that fails (after its retries)
does not stop the others, and nothing here touches the adapter files: a failed hot-swap
never undoes a publication. Only the URLs and commands from the configuration are used.

How clients find the newest name: a version is served as `<name>-<8 hex digest>` (`tiny-v0007-1a2b3c4d`,
AdapterRef.served_name). After a swap where every vllm/sglang target has the version loaded,
`newest_name_file` (if configured) holds that served name (`tiny-v0007-1a2b3c4d\\n`, replaced
atomically); the webhook body carries it (`served_name`). Clients must
not take the highest version listed by /v1/models: after a rollback that is the bad one.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from jobs.hotswap import command, full_model, lora_server, webhook
from jobs.hotswap.config import (
    CommandTarget,
    HotswapConfig,
    LoraServerTarget,
    SecretError,
    Target,
    WebhookTarget,
)
from jobs.hotswap.core import (
    AdapterRef,
    Clock,
    HotswapOutcome,
    Sleep,
    backoff_delays,
)
from jobs.hotswap.lora_server import plan_unloads
from jobs.hotswap.webhook import verify_signature

__all__ = [
    "AdapterRef",
    "CommandTarget",
    "HotswapConfig",
    "HotswapOutcome",
    "LoraServerTarget",
    "SecretError",
    "Target",
    "WebhookTarget",
    "notify_all",
    "notify_one",
    "plan_unloads",
    "verify_signature",
    "worst_case_seconds",
    "write_newest_name",
]

_log = structlog.get_logger("nightshift.hotswap")


def notify_one(
    t: Target, adapter: AdapterRef, *, sleep: Sleep = time.sleep, clock: Clock = time.monotonic, log: Any = _log
) -> HotswapOutcome:
    if isinstance(t, LoraServerTarget) and not adapter.method.is_adapter:  # a whole model: not a LoRA load
        return full_model.swap(t, adapter, sleep=sleep, clock=clock, log=log)
    if isinstance(t, LoraServerTarget):
        return lora_server.swap(t, adapter, sleep=sleep, clock=clock, log=log)
    if isinstance(t, WebhookTarget):
        return webhook.notify(t, adapter, sleep=sleep, clock=clock, log=log)
    return command.run(t, adapter, sleep=sleep, clock=clock, log=log)


def notify_all(
    cfg: HotswapConfig,
    adapter: AdapterRef,
    *,
    sleep: Sleep = time.sleep,
    clock: Clock = time.monotonic,
    log: Any = _log,
) -> list[HotswapOutcome]:
    """Notify every target; log each outcome; update newest_name_file when the servers have it."""
    outcomes: list[HotswapOutcome] = []
    for t in cfg.targets:
        if isinstance(t, WebhookTarget) and "promoted" not in t.events:
            continue  # a webhook subscribed to other events only (jobs.hotswap.events)
        outcome = notify_one(t, adapter, sleep=sleep, clock=clock, log=log)
        fields = {
            "target": t.name,
            "kind": t.kind,
            "version": adapter.version,
            "name": adapter.name,
            "served_name": adapter.served_name if adapter.method.is_adapter else None,
            "attempts": outcome.attempts,
            "seconds": round(outcome.seconds, 3),
        }
        if outcome.ok:
            log.info("hotswap.ok", **fields, detail=outcome.detail)
        else:
            log.error("hotswap.failed", **fields, error=outcome.error, detail=outcome.detail)
        outcomes.append(outcome)
    servers_ok = all(o.ok for o in outcomes if o.kind in ("vllm", "sglang"))
    if cfg.newest_name_file is not None and servers_ok:
        write_newest_name(cfg.newest_name_file, adapter.served_name if adapter.method.is_adapter else adapter.name)
    return outcomes


def worst_case_seconds(cfg: HotswapConfig) -> float:
    """How long notify_all can take at most: each target's attempts, each bounded by one deadline
    (timeout_s; a whole-model reload's reload_timeout_s), and the waits between them. Whoever waits
    for an announcement in progress (rollback, promote) waits this long, not a guess."""
    total = 0.0
    for t in cfg.targets:
        per_attempt = max(t.timeout_s, t.reload_timeout_s) if isinstance(t, LoraServerTarget) else t.timeout_s
        total += (t.retries + 1) * per_attempt + sum(backoff_delays(t.retries, t.backoff_s))
    return total


def write_newest_name(path: Path, name: str) -> None:
    """Replace `path` with `name + "\\n"` atomically (temp file in the same directory, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
