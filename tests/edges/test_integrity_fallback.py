"""Issue 40: a torn or bit-flipped adapter in service is detected by its checksums and the night falls back
to the previous good version (its lineage's nearest ancestor that verifies) instead of stopping every night.
(Training checkpoints check their own sha256 and fall back in jobs/training/checkpoints.py: tests/training.)"""

from __future__ import annotations

import json

from jobs.store.ledger import Ledger
from tests.conftest import alpaca, run, write_jsonl


def test_a_bit_flipped_adapter_in_service_falls_back_to_its_parent_and_its_samples_are_trained_again(night_env):
    inbox, make = night_env
    cfg = make(eval={"gate": []})
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(10)])
    assert run(cfg, night="n1")["outcome"] == "succeeded"
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " b") for i in range(10)])
    assert run(cfg, night="n2")["outcome"] == "succeeded"
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    by_v2 = {r[0] for r in led.db.execute("SELECT id FROM samples WHERE version=2 AND status='trained'")}
    assert by_v2
    f = cfg.state_dir / "adapters" / "tiny-v0002" / "adapter_model.safetensors"
    f.chmod(0o640)
    with open(f, "r+b") as fh:  # one flipped bit
        fh.seek(200)
        b = fh.read(1)
        fh.seek(200)
        fh.write(bytes([b[0] ^ 0x01]))

    write_jsonl(inbox / "c.jsonl", [alpaca(i, " c") for i in range(5)])
    s = run(cfg, night="n3")
    assert s["outcome"] == "succeeded" and s["parent_version"] == 1, s["error"]
    manifest = json.loads((cfg.state_dir / "current" / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["parent_version"] == 1
    # v2's samples are in no servable adapter any more: trained again, once, by v3
    now = {r[0]: (r[1], r[2]) for r in led.db.execute("SELECT id, status, version FROM samples")}
    assert all(now[i] in (("trained", 3), ("heldout", 3)) for i in by_v2), {i: now[i] for i in by_v2}
    assert led.sample_counts().get("pending", 0) == 0
    q = "SELECT detail FROM events WHERE kind='integrity_fallback'"
    events = [json.loads(r["detail"]) for r in led.db.execute(q)]
    assert events and events[0]["from_version"] == 2 and "sha256" in events[0]["why"]
    assert [r["action"] for r in led.promotions()][-2:] == ["rollback", "night"]
