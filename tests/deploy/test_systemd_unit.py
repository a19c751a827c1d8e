"""deploy/systemd/nightshift.service: systemd-analyze verify is silent, security exposure stays low.

CI installs systemd (apt-get install systemd) for systemd-analyze; without it these skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import hang_bound

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "nightshift.service"
EXEC = "/opt/nightshift/venv/bin/nightshift"
# `systemd-analyze security --threshold` counts tenths: 16 = exposure 1.6 ("OK"), what the unit scores
# today. Raise it only with a reason in the unit's comments.
EXPOSURE_THRESHOLD = 16
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")


def settings(text: str) -> dict[str, list[str]]:
    """`Section.Key` -> values, in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def test_unit_says_what_the_service_needs() -> None:
    s = settings(UNIT.read_text())
    expected = {
        "Service.Type": "notify",
        "Service.NotifyAccess": "main",
        "Service.ExecStart": f"{EXEC} run --config /etc/nightshift/nightshift.toml",
        "Service.Restart": "on-failure",
        "Service.RestartPreventExitStatus": "2 5",  # a bad config, a second instance: no restart loop
        "Service.KillMode": "mixed",
        "Service.User": "nightshift",
        "Service.Group": "nightshift",
        "Service.StateDirectory": "nightshift",
        "Service.LogsDirectory": "nightshift",
        "Service.ProtectSystem": "strict",
        "Service.PrivateDevices": "no",  # would hide the GPU
        "Service.DevicePolicy": "closed",
        "Service.DeviceAllow": "char-nvidia* rw",
        "Service.MemoryDenyWriteExecute": "no",  # CUDA / triton JIT
        "Service.NoNewPrivileges": "yes",
        "Service.CapabilityBoundingSet": "",
        "Install.WantedBy": "multi-user.target",
    }
    for key, value in expected.items():
        assert s.get(key) == [value], key
    assert "WatchdogSec" in "".join(s) and "TimeoutStopSec" in "".join(s)


def _installable_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart pointing at an executable that exists, so verify checks it."""
    exe = tmp_path / "bin" / "nightshift"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    text = UNIT.read_text() if text is None else text
    assert EXEC in text
    unit = tmp_path / "nightshift.service"
    unit.write_text(text.replace(EXEC, str(exe)))
    return unit


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=hang_bound(120), check=False)


@needs_analyze
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    r = _analyze("verify", str(_installable_copy(tmp_path)))
    assert (r.returncode, r.stdout + r.stderr) == (0, "")  # verify warns with rc 0: silence is the check


@needs_analyze
def test_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("KillMode=mixed", "KillMode=mixd")
    r = _analyze("verify", str(_installable_copy(tmp_path, broken)))
    assert "KillMode" in r.stdout + r.stderr or "kill mode" in r.stdout + r.stderr


@needs_analyze
def test_security_exposure_is_low(tmp_path: Path) -> None:
    unit = _installable_copy(tmp_path)
    r = _analyze("security", "--offline=yes", f"--threshold={EXPOSURE_THRESHOLD}", str(unit))
    if "--offline" in r.stderr and "unrecognized" in r.stderr:
        pytest.skip("systemd-analyze too old for --offline (needs systemd >= 250)")
    m = re.search(r"Overall exposure level for nightshift\.service: ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert r.returncode == 0, f"exposure {m[1]} > {EXPOSURE_THRESHOLD / 10}:\n{r.stdout}"
