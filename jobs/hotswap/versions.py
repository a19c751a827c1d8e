"""Telling the servers about published versions: the night's announcement, the announcement after an
operator's promote or rollback (daemon.adapters_cli), a re-send, and the re-send at a start. Above both
the store (files, ledger, locks; no network) and the targets.

`hotswap.lock` is held around each announcement, and whoever announces checks under it that the
version is still the one in service, so announcements never cross: the last one the targets hear is
the version behind `current`. A promote or rollback waits for an announcement in progress as long as
that one can last (worst_case_seconds: every attempt has one deadline), so it always gets to tell the
servers, even behind a swap stuck on a server that trickles its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import structlog

from jobs.contract import HotswapOutcome, Method
from jobs.hotswap import AdapterRef, HotswapConfig, notify_all, worst_case_seconds
from jobs.store.adapters import AdapterError, Adapters, VersionInfo
from jobs.store.ledger import Ledger
from jobs.store.locking import StateLock
from jobs.store.paths import StatePaths
from jobs.store.registry import Registry

log = structlog.get_logger("nightshift.hotswap")
Notify = Callable[[HotswapConfig, AdapterRef], list[HotswapOutcome]]


def announce(
    registry: Registry,
    ledger: Ledger,
    cfg: HotswapConfig,
    version: int,
    path: Path,
    *,
    trigger: str,
    run_id: str | None = None,
    notify: Notify = notify_all,
    only_if_current: bool = True,
    on_outcome: Callable[[HotswapOutcome], None] = lambda _: None,
    lock_timeout: float = 600.0,
) -> list[HotswapOutcome] | None:
    """Verify the version, then notify every target and record each outcome (ledger, log, callback).

    None when `only_if_current` and `current` moved on meanwhile: whoever moved it announces.
    IntegrityError when the files do not match the manifest: nothing is sent. The wait for another
    announcement is `lock_timeout` plus as long as that one can last.
    """
    wait = lock_timeout + worst_case_seconds(cfg)
    with StateLock(StatePaths(registry.state_dir).hotswap_lock, timeout=wait, what=f"hotswap ({trigger})"):
        if only_if_current and registry.current() != Path(path).resolve():
            log.warning("hotswap.skipped", version=version, reason="no longer the version in service")
            return None
        manifest = registry.verify(path)
        ref = AdapterRef(
            version=version,
            name=Path(path).name,
            path=Path(path).resolve(),
            base_model=str((manifest.get("base_model") or {}).get("path", "")),
            manifest=manifest,
            method=Method(manifest.get("method") or Method.qlora),
        )
        outcomes = notify(cfg, ref)
        for o in outcomes:
            ledger.record_hotswap(version, o, trigger=trigger, run_id=run_id)
            on_outcome(o)
    return outcomes


def send(ad: Adapters, cfg: HotswapConfig, ref: str | int | None = None, *, trigger: str,
         only_if_current: bool = False, notify: Notify = notify_all) -> tuple[VersionInfo, list[HotswapOutcome] | None]:
    """Send a version (default: the one in service) to every target. None: skipped because
    `only_if_current` and it is no longer in service."""
    info = ad.get("current" if ref is None else ref)
    if info.status == "pruned" or not info.on_disk:
        raise AdapterError(f"{info.name} is not on disk ({info.status})")
    outcomes = announce(ad.registry, ad.ledger, cfg, info.version, info.path, trigger=trigger, notify=notify,
                        only_if_current=only_if_current, lock_timeout=ad.cfg.lock_timeout_seconds)
    return info, outcomes


def resend_if_unheard(ad: Adapters, cfg: HotswapConfig, *, notify: Notify = notify_all,
                      clock: Callable[[], float] = time.time) -> list[HotswapOutcome] | None:
    """At a start: where the version in service has a target whose last announcement failed (a night
    cut in its hot-swap, a server that was down), send it again. None: nothing to re-send."""
    current = ad.registry.current_version()
    if current is None or not cfg.targets:
        return None
    last: dict[str, bool] = {}
    for row in ad.ledger.hotswaps(current):
        last[row["target"]] = bool(row["ok"])
    if all(last.get(t.name, False) for t in cfg.targets):
        return None
    return send(ad, cfg, current, trigger="start", only_if_current=True, notify=notify)[1]
