"""StatePaths names the state directory's layout once; the store's own classes find their files through it."""

from __future__ import annotations

from pathlib import Path

from jobs.store.ledger import Ledger
from jobs.store.locking import night_lock
from jobs.store.paths import StatePaths
from jobs.store.registry import Registry


def test_the_layout_of_a_state_directory():
    p = StatePaths("/var/lib/nightshift")  # a str as the settings hold it
    root = Path("/var/lib/nightshift")
    assert p.root == root and p == StatePaths(root)
    assert (p.ledger, p.lock, p.night_lock, p.daemon_lock, p.hotswap_lock) == (
        root / "ledger.sqlite", root / "lock", root / "night.lock", root / "daemon.lock", root / "hotswap.lock")
    assert (p.adapters, p.current, p.models, p.calibrate) == (
        root / "adapters", root / "current", root / "models", root / "calibrate")
    assert p.run_checkpoints("r1") == root / "checkpoints" / "r1"
    assert p.rank_scratch("r1", 2) == root / "ranks" / "r1-rank2"
    assert p.quarantine_file("r1") == root / "quarantine" / "r1.jsonl"
    assert (p.token_cache, p.score_cache) == (root / "cache" / "tokens", root / "cache" / "scores")


def test_the_store_writes_where_state_paths_says(tmp_path):
    p = StatePaths(tmp_path)
    Ledger(p.ledger).close()
    registry = Registry(tmp_path)
    with night_lock(tmp_path):
        assert p.night_lock.exists()
    assert p.ledger.is_file() and registry.adapters == p.adapters and registry.current_link == p.current
