"""The installed product is `daemon` and `jobs`: the wheel built from this checkout holds no benchmark module
(the benchmark's stacks and harness run from a checkout, `python -m benchmarks`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, hang_bound

# what setuptools reads to build the wheel; copied so the build leaves nothing in the checkout
SOURCES = ("pyproject.toml", "README.md", "daemon", "jobs", "benchmarks")


def wheel_names(tmp_path: Path) -> list[str]:
    src = tmp_path / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (REPO / name).exists():
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=hang_bound(600))
    if r.returncode != 0 and "No module named" in r.stderr and "setuptools" in r.stderr:
        pytest.skip("setuptools is not installed here: the wheel cannot be built without the network")
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("nightshift-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_product_and_no_benchmark_module(tmp_path):
    names = wheel_names(tmp_path)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"daemon", "jobs"}, tops
    assert {"daemon/cli.py", "jobs/night/run.py", "jobs/night/calibrate.py", "jobs/training/probe.py"} <= set(names)
    bench = [n for n in names if n.endswith(".py") and any("bench" in part for part in n.split("/"))]
    assert not bench, f"benchmark modules in the wheel: {bench}"
