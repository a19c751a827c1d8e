"""The compile caches under the state directory come with a job id, so torch's local PGO (which inputs of a
compiled region are dynamic) carries from one night's process to the next (issue 11: the first step)."""

import os

import pytest
import torch

from jobs.training.unsloth_backend import compile_job_id, setup_caches

KEYS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS",
        "PYTORCH_CUDA_ALLOC_CONF", "UNSLOTH_MOE_BACKEND", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
        "UNSLOTH_COMPILE_LOCATION", "UNSLOTH_MEGA_CACHE_DIR", "UNSLOTH_MEGA_CACHE", "TORCH_COMPILE_JOB_ID")


@pytest.fixture
def clean_env(monkeypatch):
    for k in KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.compiler.config, "job_id", None)


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
