"""`nightshift calibrate` measures per count of cards: one process, or one per card through torchrun."""

import json
from pathlib import Path

from daemon.calibrate_launch import calibrate_command
from daemon.settings import load_settings
from jobs.night.model import throughput_key
from tests.conftest import toml_config


def test_one_card_is_one_process_with_the_config_on_stdin(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)
    with calibrate_command(load_settings(cfg), out=tmp_path / "o", seconds=5) as (cmd, env, stdin):
        assert cmd[1:3] == ["-m", "jobs.night.calibrate"] and "--config" not in cmd
        assert json.loads(stdin)["train"]["gpus"] == 1 and "OMP_NUM_THREADS" not in env


def test_two_cards_go_through_torchrun_with_the_config_in_a_file_on_one_host(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model, gpus=2, more="""
[train.distributed]
nnodes = 2
rdzv_endpoint = "10.0.0.1:29400"
""")
    with calibrate_command(load_settings(cfg), out=tmp_path / "o", seconds=5) as (cmd, _, stdin):
        assert stdin is None and cmd[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in cmd
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--nnodes" not in cmd  # this host's cards
        path = cmd[cmd.index("--config") + 1]
        night = json.loads(Path(path).read_text())
        assert night["train"]["distributed"]["nnodes"] == 1
    assert not Path(path).exists()  # removed after the run


def test_the_throughput_key_is_per_count_and_one_card_keeps_the_old_key(tmp_path, tiny_model):
    cfg, _ = toml_config(tmp_path, tiny_model)
    night = load_settings(cfg).night_config()
    one, two = (throughput_key(night, "fp", "unsloth", "H200", gpus=n) for n in (1, 2))
    assert one == throughput_key(night, "fp", "unsloth", "H200") and one != two
