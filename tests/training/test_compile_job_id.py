"""The compile caches under the state directory come with a job id, so torch's local PGO (which inputs of a
compiled region are dynamic) carries from one night's process to the next (issue 11: the first step)."""

import os

import pytest
import torch

from jobs.training.backends.unsloth import compile_job_id, setup_caches
from tests.conftest import hang_bound

KEYS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS",
        "PYTORCH_CUDA_ALLOC_CONF", "UNSLOTH_MOE_BACKEND", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
        "UNSLOTH_COMPILE_LOCATION", "UNSLOTH_MEGA_CACHE_DIR", "UNSLOTH_MEGA_CACHE", "TORCH_COMPILE_JOB_ID")


@pytest.fixture
def clean_env(monkeypatch):
    """torch's own patch, not monkeypatch.setattr: pytest >= 9.2 restores a module attribute missing from its
    __dict__ by deleting it, which hides a torch config key for every later test ("job_id does not exist")."""
    for k in KEYS:
        monkeypatch.delenv(k, raising=False)
    with torch.compiler.config.patch(job_id=None):
        yield


def test_one_state_directory_one_job_id_for_every_process(tmp_path, clean_env):
    env = setup_caches(tmp_path / "a" / "models")
    job = env["TORCH_COMPILE_JOB_ID"]
    assert job == os.environ["TORCH_COMPILE_JOB_ID"] == torch.compiler.config.job_id  # torch was imported first
    assert job == compile_job_id(tmp_path / "a" / "models" / "compile") != compile_job_id(tmp_path / "b" / "compile")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "a" / "models" / "compile"))


def test_an_operators_own_job_id_is_kept(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_JOB_ID", "lab-nights")
    setup_caches(tmp_path / "models")
    assert os.environ["TORCH_COMPILE_JOB_ID"] == "lab-nights" == torch.compiler.config.job_id


def test_no_cache_directory_no_job_id(clean_env):
    setup_caches(None)
    assert "TORCH_COMPILE_JOB_ID" not in os.environ and torch.compiler.config.job_id is None


COMPILED = """
import sys
from pathlib import Path

from jobs.training.backends.unsloth import setup_caches

if sys.argv[1] != "-":
    setup_caches(Path(sys.argv[1]))
import torch
from torch._dynamo.utils import counters


@torch.compile(backend="eager")
def region(x, n):  # n: a Python int, as a packed batch's longest sample reaches a compiled layer
    return x * n + 1


for n in map(int, sys.argv[2:]):
    region(torch.ones(3), n)
print(counters["stats"]["unique_graphs"])
"""


def graphs(script, cache, *values, env):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(script), str(cache), *map(str, values)], capture_output=True, text=True,
                         env=env, timeout=hang_bound(300), check=True)
    return int(out.stdout.split()[-1])


def test_the_next_process_compiles_dynamic_from_its_first_call_what_the_last_found_dynamic(tmp_path):
    """torch's local PGO, which the job id turns on: a process whose region saw two values compiled twice
    (static, then dynamic); the next process on the same caches compiles once. Without the caches' job id
    the next process compiles twice again (as a night's first step did, if that is what slowed it)."""
    from pathlib import Path

    script = tmp_path / "region.py"
    script.write_text(COMPILED)
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    assert graphs(script, tmp_path / "models", 5, 7, env=env) == 2
    assert graphs(script, tmp_path / "models", 9, 11, env=env) == 1
    plain = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "plain")}
    assert graphs(script, "-", 5, 7, env=plain) == 2
    assert graphs(script, "-", 9, 11, env=plain) == 2
