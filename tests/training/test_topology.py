"""[train] gpus / devices / [train.distributed]: the world and the launch command, without torch."""

import pytest

from daemon.settings import ConfigError, load_settings
from jobs.training.config import TrainConfig
from jobs.training.ranks.topology import (
    DistributedConfig,
    World,
    launch_command,
    launch_env,
    resolve_world,
    visible_gpus,
)
from tests.conftest import hang_bound

ONE_HOST = DistributedConfig()


def test_one_process_is_the_plain_child():
    w = resolve_world(1, None, ONE_HOST, visible=0)
    assert w == World(nproc=1, cuda_visible=None) and not w.launcher
    assert launch_command(w, ONE_HOST, "jobs.night.child", ["--night", "n"], python="py") == [
        "py", "-m", "jobs.night.child", "--night", "n"]


def test_n_processes_without_a_gpu_are_cpu_processes_through_torchrun(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # an operator's value is kept (the suite may set one)
    w = resolve_world(2, None, ONE_HOST, visible=0)
    assert w.nproc == 2 and w.launcher and w.cuda_visible is None
    cmd = launch_command(w, ONE_HOST, "jobs.night.child", ["--config", "f.json"], python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert cmd[-4:] == ["-m", "jobs.night.child", "--config", "f.json"]
    env = launch_env(w, grace_seconds=60, cpus=8)
    assert env["OMP_NUM_THREADS"] == "4" and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "55"


def test_all_and_devices_pick_the_cards():
    assert resolve_world("all", None, ONE_HOST, visible=4).nproc == 4
    assert resolve_world("all", None, ONE_HOST, visible=0).nproc == 1  # no GPU: one CPU process
    w = resolve_world("all", [2, 3], ONE_HOST, visible=4)
    assert w.nproc == 2 and launch_env(w)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert resolve_world(1, [3], ONE_HOST, visible=4).cuda_visible == "3"


def test_more_gpus_than_the_host_has_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[train\] gpus: 4 asked, 2 visible"):
        resolve_world(4, None, ONE_HOST, visible=2)
    with pytest.raises(ValueError, match=r"\[train\] devices lists 1"):
        resolve_world(2, [0], ONE_HOST, visible=4)


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_several_hosts_use_the_static_rendezvous_of_node_0():
    d = DistributedConfig(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400", join_timeout_seconds=90)
    w = resolve_world(1, None, d, visible=0)
    assert w.launcher and w.size == 2
    cmd = launch_command(w, d, "jobs.night.child", ["--join"], python="py")
    args = dict(zip(cmd[3:-3:2], cmd[4:-3:2], strict=False))
    assert args["--nnodes"] == "2" and args["--node-rank"] == "1" and args["--rdzv-backend"] == "static"
    assert args["--rdzv-endpoint"] == "10.0.0.5:29400" and args["--rdzv-conf"] == "timeout=90"
    assert "--standalone" not in cmd and cmd[-3:] == ["-m", "jobs.night.child", "--join"]


def test_bad_distributed_config_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"rdzv_endpoint: required with nnodes > 1"):
        DistributedConfig(nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank: 2 must be below nnodes"):
        DistributedConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        DistributedConfig(rdzv_endpoint="no-port")
    with pytest.raises(ValueError, match="at least 1"):
        TrainConfig(gpus=0)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\npath = "m"\n[train]\ngpus = "some"\n[train.distributed]\nnnodes = 2\n')
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    text = str(e.value)
    assert "[train] gpus" in text and "[train.distributed] rdzv_endpoint: required" in text


def test_a_cpu_night_takes_the_free_cores_and_keeps_an_operators_choice():
    from jobs.training.ranks.topology import cpu_threads

    assert cpu_threads(2, 14.2, {}) == 1  # a busy 2-core box: one thread, not two spinning against each other
    assert cpu_threads(2, 0.3, {}) == 2 and cpu_threads(16, 3.9, {}) == 13
    assert cpu_threads(2, 0.3, {"OMP_NUM_THREADS": "2"}) is None  # torch read it: kept


def test_the_child_sets_its_threads_before_training(tmp_path):
    """The night's child applies it itself (the README no longer asks for OMP_NUM_THREADS)."""
    import os
    import subprocess
    import sys

    code = ("import os, torch; os.environ.pop('OMP_NUM_THREADS', None); from jobs.training.ranks.topology import "
            "set_cpu_threads; n = set_cpu_threads(); print(n, torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=hang_bound(600), check=True)
    n, got = out.stdout.split()
    assert n == got and int(n) >= 1
