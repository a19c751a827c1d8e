"""Every path of the state directory, named once.

Why: the layout was spelled by string joins in many modules (`"ledger.sqlite"` in eleven files); a file
renamed in one of them would leave the others reading an empty place. Each place is a property here;
the code asks `StatePaths(state_dir).ledger`, never joins a name itself (tests/test_structure.py checks).

    <state_dir>/
      ledger.sqlite            the source of truth (runs, samples, versions, throughput)
      lock                     the registry lock: publish, promote, roll back, build the model
      night.lock               one night (service, `once`, calibrate) at a time
      daemon.lock              one service per state directory
      hotswap.lock             announcing a version to the inference servers
      adapters/<name>/         published versions, write-once
      current                  symbolic link to the version in service
      checkpoints/<run_id>/    a night's resumable checkpoints
      ranks/<run_id>-rank<N>/  the scratch of a rank other than 0
      quarantine/<run_id>.jsonl  records refused, with the reason
      cache/tokens/            token ids of pulled samples
      cache/scores/            per-sample scores of versions on fixed sets
      models/                  models built or converted here, and the compile caches
      calibrate/               `nightshift calibrate`'s measurement (default --out)
      logs/once-*.jsonl        the structured log of `nightshift once` at a terminal (the last few kept)
      capture/                 `nightshift capture`'s journal of captured replies
      by-adapter/<name>/       [[adapters]]: each adapter's own state directory, of this very layout
                               (the top one then keeps what they share: the night lock, the measured
                               throughput in its ledger, the model caches, and the night's own run)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StatePaths:
    """The places of one state directory (nothing is created or checked here)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.sqlite"

    @property
    def lock(self) -> Path:
        """The registry lock (publish, promote, roll back, build the model)."""
        return self.root / "lock"

    @property
    def night_lock(self) -> Path:
        return self.root / "night.lock"

    @property
    def daemon_lock(self) -> Path:
        return self.root / "daemon.lock"

    @property
    def hotswap_lock(self) -> Path:
        return self.root / "hotswap.lock"

    @property
    def adapters(self) -> Path:
        return self.root / "adapters"

    @property
    def current(self) -> Path:
        return self.root / "current"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def run_checkpoints(self, run_id: str) -> Path:
        return self.checkpoints / run_id

    def rank_scratch(self, run_id: str, rank: int) -> Path:
        return self.root / "ranks" / f"{run_id}-rank{rank}"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def quarantine_file(self, run_id: str) -> Path:
        return self.quarantine / f"{run_id}.jsonl"

    @property
    def token_cache(self) -> Path:
        return self.root / "cache" / "tokens"

    @property
    def score_cache(self) -> Path:
        return self.root / "cache" / "scores"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def calibrate(self) -> Path:
        return self.root / "calibrate"

    @property
    def once_logs(self) -> Path:
        """The structured log of each `nightshift once` run at a terminal (the screen shows the plain stream)."""
        return self.root / "logs"

    @property
    def capture(self) -> Path:
        """`nightshift capture`'s journal of captured replies (feedback itself lands in the inbox)."""
        return self.root / "capture"

    def adapter(self, name: str) -> StatePaths:
        """[[adapters]]: one adapter's own state directory (`adapters/` already holds the published versions
        of a directory of one adapter, so the adapters' own directories live beside it)."""
        return StatePaths(self.root / "by-adapter" / name)

    @property
    def adapter_dirs(self) -> Path:
        return self.root / "by-adapter"
