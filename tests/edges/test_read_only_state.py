"""Issue 40: permissions are named as permissions, never as damage; read-only commands work on a
read-only state directory.

The tests run as root, for whom chmod stops nothing. `chattr +i` does: the kernel itself refuses every
write (EPERM) to an immutable file or directory, for root too, so the product meets the very errors a
read-only state directory gives it. Where the file system has no immutable flag, an injected
PermissionError at the open stands in (the message test below runs everywhere)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.store.files import DamagedState, StatePermission
from jobs.store.ledger import Ledger
from tests.conftest import REPO, hang_bound
from tests.store.test_adapters import craft


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=hang_bound(240), env=dict(os.environ))


@contextlib.contextmanager
def immutable(root: Path):
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    paths = [root, *root.rglob("*")]
    r = subprocess.run(["chattr", "+i", *map(str, [p for p in paths if not p.is_symlink()])],
                       capture_output=True, text=True)
    try:
        if r.returncode != 0:
            pytest.skip(f"this file system has no immutable flag: {r.stderr.strip()}")
        try:
            (root / ".probe").write_text("x")
        except PermissionError:
            pass
        else:
            pytest.skip("chattr +i does not stop writes here")
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(root)], capture_output=True)


@pytest.fixture()
def state(tmp_path):
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)
    led = Ledger(state / "ledger.sqlite")
    led.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    led.close()
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f'state_dir = "{state}"\n[model]\npath = "{tmp_path}"\nname = "tiny"\n')
    return state, cfg


@pytest.mark.slow
def test_read_only_commands_work_on_a_read_only_state_directory_and_writes_name_the_permission(state):
    state, cfg = state
    with immutable(state):
        r = _cli(cfg, "status", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["in_service"]["name"] == "tiny-v0002"
        r = _cli(cfg, "adapters", "list", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        assert [v["name"] for v in json.loads(r.stdout)] == ["tiny-v0001", "tiny-v0002"]
        r = _cli(cfg, "doctor")
        assert "Traceback" not in r.stderr and "damaged" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        assert "permission" in r.stdout.lower() or r.returncode == 0, r.stdout
        for args in (("adapters", "rollback"), ("adapters", "pin", "1")):
            r = _cli(cfg, *args)
            out = (r.stdout + r.stderr).lower()
            assert r.returncode != 0 and "permission" in out and "damaged" not in out and "backup" not in out, out
            assert "Traceback" not in r.stderr


def test_a_ledger_that_cannot_be_opened_for_writing_is_a_permission_not_damage(state, monkeypatch):
    state, _ = state
    real_access = os.access

    def refuse(path, mode, *a, **k):  # what the kernel says of a file this user may not write
        if str(path).endswith("ledger.sqlite") and mode & os.W_OK:
            return False
        return real_access(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", refuse)
    with pytest.raises(StatePermission, match=r"permission denied.*left as they are") as e:
        Ledger(state / "ledger.sqlite")
    assert not isinstance(e.value, DamagedState)
