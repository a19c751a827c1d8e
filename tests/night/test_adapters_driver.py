"""benchmarks/drivers/adapters_gpu.sh's logic on the CPU (--cpu: the tiny model), so that the GPU run the lead
starts does not fail for a silly reason: both nights run, train the same records, and the figures are written."""

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, hang_bound

pytestmark = pytest.mark.slow


def test_the_driver_runs_one_night_of_one_and_one_of_four_on_the_same_records(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECORDS": "120", "WINDOW_MIN": "5"}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "drivers" / "adapters_gpu.sh"), "--cpu", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_bound(600))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads((out / "result.json").read_text())
    one, four = result["one"], result["four"]
    assert one["exit"] == 0 and four["exit"] == 0, (out / "driver.log").read_text()
    assert one["outcome"] == "succeeded" and four["outcome"] == "succeeded"
    assert [a["adapter"] for a in four["adapters"]] == ["task1", "task2", "task3", "task4"]
    assert all(a["outcome"] == "succeeded" and a["promoted"] for a in four["adapters"])
    assert len(four["shares"]) == 4 and one["deferred_samples"] == four["deferred_samples"] == 0
    # every record trained or held out in both: the same records, dealt to one inbox or to four
    assert one["trained_samples"] > 0 and four["trained_samples"] > 0
    assert result["ratio_wall"] > 0 and (out / "result.md").read_text().count("| one |") == 1


def test_parallel_nights_need_two_cards(tmp_path):
    """PARALLEL=1 puts each night on its own card: with fewer than two it is refused before anything is built."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")  # one card
    smi.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARALLEL": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "drivers" / "adapters_gpu.sh"), str(tmp_path / "out")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_bound(60))
    assert r.returncode == 2 and "PARALLEL=1 needs 2 GPUs" in r.stdout + r.stderr and "found 1" in r.stdout
    assert not (tmp_path / "out" / "meta.txt").exists()
