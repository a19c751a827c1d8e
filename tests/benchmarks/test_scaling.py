"""`python -m benchmarks scaling`: the efficiency arithmetic, the launch, and a CPU run of our path on 1 and 2
ranks over gloo (the GPU measurement: `python -m benchmarks scaling --arch llama3.1-8b --gpus 2`)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.cli import build_parser
from benchmarks.scaling import command, efficiency, table
from benchmarks.settings import BenchSettings
from tests.conftest import REPO, hang_bound


def test_efficiency_is_throughput_on_n_over_n_times_one():
    rows = [{"stack": "ours", "profile": "alpaca", "gpus": 1, "real_tok_s": 15_000.0},
            {"stack": "ours", "profile": "alpaca", "gpus": 2, "real_tok_s": 29_100.0},
            {"stack": "exxact", "profile": "seq 512 x batch 2", "gpus": 1, "real_tok_s": 4_962.0},
            {"stack": "exxact", "profile": "seq 512 x batch 2", "gpus": 2, "real_tok_s": 9_537.0}]
    lines = {x["stack"]: x for x in efficiency(rows)}
    assert lines["ours"]["efficiency"] == pytest.approx(0.97) and lines["ours"]["speedup"] == pytest.approx(1.94)
    assert lines["exxact"]["efficiency"] == pytest.approx(9_537 / 9_924)
    text = table(efficiency(rows))
    assert "97.0 %" in text and "96.1 %" in text  # ours, and the published figure beside the Exxact row


def test_the_scaling_mode_parses_and_each_count_is_a_torchrun_group(tmp_path):
    a = build_parser().parse_args(["scaling", "--arch", "llama3.1-8b", "--gpus", "4"])
    s = BenchSettings.from_args(a)
    assert s.gpus == 4 and s.scaling_workloads == ("ours", "exxact")
    cmd = command("exxact", 4, model=tmp_path, rows=tmp_path / "r", settings=tmp_path / "s.json")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--settings") + 1] == str(tmp_path / "s.json")  # not stdin: every worker shares it
    with pytest.raises(ValueError):
        BenchSettings(arch="x", scaling_workloads=("nope",))


@pytest.mark.slow
def test_our_path_on_one_and_two_cpu_ranks(tmp_path, tiny_model):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "scaling", "--model", str(tiny_model), "--gpus", "2",
                        "--scaling-workloads", "ours", "--budget", "256", "--warmup", "1", "--max-steps", "3",
                        "--seconds", "5", "--data-tokens", "2000", "--profiles", "alpaca", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=hang_bound(300),
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    doc = json.loads((out / f"scaling-{tiny_model.name}.json").read_text())
    assert sorted(row["gpus"] for row in doc["rows"]) == [1, 2]
    assert all(row["timed_steps"] == 3 and row["tokens_per_step_per_gpu"] == 256 for row in doc["rows"])
    [line] = doc["scaling"]
    assert line["stack"] == "ours" and line["gpus"] == 2 and line["efficiency"] > 0
    assert "| ours | alpaca | 2 |" in r.stdout
