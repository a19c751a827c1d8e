"""The command line of `nightshift calibrate`'s child: one process, or one per card through torchrun.

Calibrate measures this host's cards: a `[train.distributed]` night on several hosts plans from
its own measured nights (their throughput is recorded under the key of the whole night's count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from daemon.settings import Settings
from daemon.supervisor import night_world
from jobs.training.ranks.topology import DistributedConfig, launch_command, launch_env


@contextlib.contextmanager
def calibrate_command(s: Settings, *, out: Path, seconds: float, extra: list[str] | None = None,
                      ) -> Iterator[tuple[list[str], dict[str, str], str | None]]:
    """(argv, environment additions, stdin text or None); the config file of a torchrun launch is removed after.
    `extra`: more arguments for jobs.night.calibrate."""
    night = s.night_config()
    one_host = DistributedConfig(timeout_seconds=night.train.distributed.timeout_seconds,
                                 setup_timeout_seconds=night.train.distributed.setup_timeout_seconds,
                                 backend=night.train.distributed.backend)
    night.train.distributed = one_host
    world = dataclasses.replace(night_world(s.train), nnodes=1)
    args = ["--out", str(out), "--seconds", str(seconds), *(extra or [])]
    if not world.launcher:
        yield launch_command(world, one_host, "jobs.night.calibrate", args), launch_env(world), night.model_dump_json()
        return
    fd, path = tempfile.mkstemp(prefix="nightshift-calibrate-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(night.model_dump_json())
        cmd = launch_command(world, one_host, "jobs.night.calibrate", [*args, "--config", path])
        yield cmd, launch_env(world), None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
