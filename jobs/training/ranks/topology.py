"""How many processes train one night, on which cards and hosts, and the command that starts them.

No torch here: the daemon (which never imports torch) resolves the world and builds the launch
command. One process (the default, `[train] gpus = 1`) is started as `python -m jobs.night.child`;
several are started through PyTorch's own launcher, torchrun (`python -m torch.distributed.run`),
so that one child group's exit frees every card and the daemon still supervises a single process.

Hosts (`[train.distributed]`): torchrun's *static* rendezvous. Node 0 is the host whose daemon owns
the ledger, the registry and the plan; it hosts the rendezvous store at `rdzv_endpoint`, and its
first process is global rank 0. Why static and not c10d: c10d orders hosts by address and process
id, so the ledger's host could come out as rank 1 (`--node-rank` is ignored there); with the static
backend node_rank fixes the ranks, and its fixed membership is what a night wants
(`--max-restarts 0`: a dead rank fails the night, the daemon's retry takes over).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RDZV_ID = "nightshift"
  # one night at a time per ledger: a fixed id is enough


class DistributedConfig(BaseModel):
    """[train.distributed]: one night on several hosts (torchrun's static rendezvous)."""

    model_config = ConfigDict(extra="forbid")
    nnodes: int = Field(1, ge=1, description="hosts that train the night together")
    node_rank: int = Field(0, ge=0, description="this host's rank: 0 owns the ledger (runs `nightshift run`), "
                           "the others run `nightshift join`")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of node 0, where the rendezvous store listens")
    join_timeout_seconds: float = Field(600.0, gt=0, description="how long a host waits for the others to join")
    timeout_seconds: float = Field(600.0, gt=0, description="a training collective waiting longer than this "
                                   "fails the night (a hung rank); a dead rank fails it at once")
    setup_timeout_seconds: float = Field(7200.0, gt=0, description="how long the other ranks wait for rank 0 "
                                         "to pull, plan, load and evaluate before training starts")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL on CUDA, gloo on CPUs")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:\d{1,5}", v):
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"[train.distributed] node_rank: {self.node_rank} must be below nnodes ({self.nnodes})")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("[train.distributed] rdzv_endpoint: required with nnodes > 1 (HOST:PORT of node 0)")
        return self

    @property
    def owner(self) -> bool:
        """This host owns the ledger: it runs the night (the others join it)."""
        return self.node_rank == 0


class TrainConfigLike(Protocol):  # jobs.training.config.TrainConfig (which imports this module)
    gpus: int | Literal["all"]
    devices: list[int] | None
    distributed: DistributedConfig


@dataclass(frozen=True)
class World:
    """The processes of one host's part of a night."""

    nproc: int  # processes on this host (one per card; CPU processes where there is no GPU)
    cuda_visible: str | None  # CUDA_VISIBLE_DEVICES for them (None: leave the environment as it is)
    nnodes: int = 1

    @property
    def size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def launcher(self) -> bool:
        """Started through torchrun (several processes, or several hosts)."""
        return self.size > 1


def visible_gpus(environ: Mapping[str, str] | None = None) -> int:
    """Cards this process could use, without torch: CUDA_VISIBLE_DEVICES if set, else NVML's count."""
    env = os.environ if environ is None else environ
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([x for x in cvd.split(",") if x.strip() and x.strip() != "-1"])
    from jobs.gpu.telemetry import gpu_count

    return gpu_count()


def resolve_world(gpus: int | Literal["all"], devices: list[int] | None, dist: DistributedConfig,
                  visible: int) -> World:
    """`[train] gpus` and `devices` against what this host has; `visible` = cards seen (0: a CPU host).

    Without a GPU, `gpus = N` runs N CPU processes over gloo (the demo, the tests and CI use it)."""
    have = len(devices) if devices else visible
    if gpus == "all":
        n = max(1, have)
    else:
        n = gpus
        if have and n > have:
            where = f"[train] devices lists {len(devices)}" if devices else f"{visible} visible on this host"
            raise ValueError(f"[train] gpus: {n} asked, {where}")
    cuda_visible = ",".join(str(d) for d in devices[:n]) if devices else None
    return World(nproc=n, cuda_visible=cuda_visible, nnodes=dist.nnodes)


def night_size(train: TrainConfigLike) -> int:
    """The ranks a night of this config trains on here (the throughput key of `nightshift plan`)."""
    return resolve_world(train.gpus, train.devices, train.distributed, visible_gpus()).size


def launch_command(world: World, dist: DistributedConfig, module: str, args: list[str],
                   python: str = sys.executable) -> list[str]:
    """`python -m MODULE ARGS`, or the same through torchrun for several processes or hosts.

    `--max-restarts 0`: a failed rank fails the group (the daemon retries the night, resuming from
    its checkpoint), never a silent restart of the whole group by the launcher."""
    if not world.launcher:
        return [python, "-m", module, *args]
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(world.nproc), "--max-restarts", "0",
           "--monitor-interval", "0.5"]
    if dist.nnodes == 1:
        cmd.append("--standalone")
    else:
        assert dist.rdzv_endpoint is not None  # validated
        cmd += ["--nnodes", str(dist.nnodes), "--node-rank", str(dist.node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", dist.rdzv_endpoint, "--rdzv-id", RDZV_ID,
                "--rdzv-conf", f"timeout={int(dist.join_timeout_seconds)}"]
    return [*cmd, "-m", module, *args]


def launch_env(world: World, *, grace_seconds: float | None = None, cpus: int | None = None) -> dict[str, str]:
    """Environment additions for the launched processes.

    - CUDA_VISIBLE_DEVICES from `[train] devices`;
    - OMP_NUM_THREADS: torchrun sets 1 for several processes, which starves CPU training; here the
      cores are shared out (a value set by the operator is kept);
    - TORCH_ELASTIC_SHUTDOWN_TIMEOUT: on SIGTERM torchrun forwards the signal and SIGKILLs its workers
      after this many seconds (30 by default): give them the daemon's grace minus a margin to save."""
    env: dict[str, str] = {}
    if world.cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = world.cuda_visible
    if world.launcher:
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (cpus or os.cpu_count() or 1) // world.nproc))
        if grace_seconds is not None:
            env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(max(5, int(grace_seconds) - 5))
    return env


def cpu_threads(cpus: int, load: float, environ: Mapping[str, str]) -> int | None:
    """Threads for a night trained on the CPU, or None to keep torch's choice: an operator's OMP_NUM_THREADS
    (torch already read it). Otherwise the cores nobody else is using, at least one: on a 2-core box shared with
    other jobs torch's two threads spin against each other (the demo night: 55 s wall at load ~14 with one
    thread, 7.5 min with two; 2 min 32 s on a newcomer's busy box)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, min(cpus, cpus - int(load)))


def set_cpu_threads() -> int | None:
    """Apply cpu_threads in this process (the night's child, after torch's import, on a machine without CUDA)."""
    import torch

    if torch.cuda.is_available():
        return None
    n = cpu_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    os.getloadavg()[0], os.environ)
    if n is not None:
        torch.set_num_threads(n)
    return n
