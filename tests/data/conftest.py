"""The pull of one inbox, as the hostile-input tests drive it."""

from __future__ import annotations

import json

import pytest

from jobs.data.pull import Quarantine, pull
from jobs.data.sources import SourceConfig
from jobs.store.ledger import Ledger


@pytest.fixture()
def env(tmp_path, tokenizer):
    """An inbox, its ledger, a pull of it (one source 's') and what the pull quarantined."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    qfile = tmp_path / "quarantine" / "r1.jsonl"

    def do_pull(run_id="r1", special_tokens="escape", excerpt_bytes=16384, workers=None, **src):
        cfg = SourceConfig(name="s", inbox=inbox, settle_seconds=0, **src)
        return pull([cfg], ledger, tokenizer, run_id=run_id, quarantine=Quarantine(qfile, excerpt_bytes=excerpt_bytes),
                    max_seq_length=64, overlong="reject", special_tokens=special_tokens, excerpt_bytes=excerpt_bytes,
                    workers=workers)

    def quarantined():
        return [json.loads(x) for x in qfile.read_text().splitlines()] if qfile.exists() else []

    return inbox, ledger, do_pull, quarantined
