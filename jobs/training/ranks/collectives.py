"""The collectives of a night trained by several processes (torchrun's workers): one per card, or CPU
processes over gloo where there is no GPU.

Why by hand and not DistributedDataParallel: the step retries an out-of-memory batch as two halves
(jobs/training/step.py), so one rank may run one backward and another three. Under DDP every
backward fires its own all-reduce, and ranks with different counts pair the wrong reductions. Here
each rank runs its backwards locally and the gradients are reduced exactly once per optimizer step,
weighted by label tokens, so the step equals the step of one process over the whole global batch.
LoRA's gradients are small: one flat all-reduce is cheap. Nothing of the frozen base is ever sent.

Rules every rank follows (each rank runs the same collectives in the same order, or the night hangs):
- a step's stop decision is one all-reduce(MAX) of [signal, deadline] flags: every rank stops at the
  same step, whatever its own clock says;
- one gradient all-reduce per step carries [grads..., label tokens, loss sum, out-of-memory flag]: an
  out-of-memory on one rank makes every rank run its later steps as halves;
- the default group (NCCL on CUDA, gloo on CPUs) has `timeout_seconds`: a dead or hung rank fails the
  night instead of hanging it; a separate gloo group with `setup_timeout_seconds` carries what the
  other ranks wait for while rank 0 alone pulls, plans, loads and evaluates.

torch is imported inside functions: the child imports this module before it knows the world.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import structlog

from jobs.contract import Emit
from jobs.contract.crashpoints import declare, reached
from jobs.data.batching import IGNORE_INDEX, Batch
from jobs.training import step as one_step
from jobs.training.ranks.topology import DistributedConfig
from jobs.training.step import StepStat, is_unsloth, model_inputs

log = structlog.get_logger("nightshift.distributed")
REDUCED = declare("train.reduced", "the step's gradient all-reduce returned on this rank; its optimizer has not "
                                   "stepped yet")


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """This process is one of torchrun's workers (of a group of more than one)."""
    env = os.environ if environ is None else environ
    return "LOCAL_RANK" in env and int(env.get("WORLD_SIZE", "1")) > 1


def die_with_parent() -> None:
    """SIGKILL this worker when its launcher dies. torchrun starts each worker in a session of its
    own, so a SIGKILL of the launcher (the daemon's last resort after the grace) would orphan it
    holding its card; the kernel's parent-death signal does not let that happen."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the launcher died before the line above: nobody will collect us
        os._exit(1)


def bind_device(environ: Mapping[str, str] | None = None) -> None:
    """Put this worker on its own card before anything touches CUDA: Unsloth queries the current device
    when imported, which would otherwise open a context on card 0 in every rank."""
    env = os.environ if environ is None else environ
    if not launched(env):
        return
    import torch

    local = int(env["LOCAL_RANK"])
    if torch.cuda.is_available() and local < torch.cuda.device_count():
        torch.cuda.set_device(local)


def label_tokens(batch: Batch) -> int:
    """Tokens the loss averages over: labels that are not ignored, the first of each row aside (shifted)."""
    return sum(sum(1 for x in row[1:] if x != IGNORE_INDEX) for row in batch.labels)


class Solo:
    """One process: the night as it always ran. Every hook of the loop is a no-op."""

    rank, world, local_rank, nnodes = 0, 1, 0, 1
    is_owner = True
    others_peak: tuple[int, int] | None = None

    def agree(self, *flags: bool) -> list[bool]:
        return list(flags)

    def smallest(self, value: int) -> int:
        return value

    def broadcast(self, obj: Any) -> Any:
        return obj

    def start(self, params: Sequence[Any]) -> None:
        pass

    def finish(self) -> None:
        pass

    def step(self, model: Any, rows: Sequence[Batch], optimizer: Any, **kw: Any) -> StepStat:
        return one_step.train_step(model, rows[0], optimizer, **kw)  # looked up now: tests time the step

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


SOLO = Solo()


@dataclass
class _Share:
    tokens: int = 0  # label tokens this rank's loss summed over
    losses: list[tuple[int, Any]] = field(default_factory=list)  # (label tokens, HostLoss) of each batch it ran
    split: bool = False

    def loss_sum(self) -> float:
        """The label-token sum of this rank's loss: each batch's mean, copied to the host after its forward (read
        after the backwards were queued, it waits for no GPU work of this step's backward)."""
        return sum(n * loss.value() for n, loss in self.losses)


class Group(Solo):
    """One rank of several. `is_owner` (global rank 0) owns the night's state; the others train their
    share of each step and report nothing (jobs/night/ranks.py)."""

    def __init__(self, cfg: DistributedConfig, environ: Mapping[str, str]) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        self.local_rank = int(environ.get("LOCAL_RANK", "0"))
        self.node = int(environ.get("GROUP_RANK", "0"))  # the host: 0 is rank 0's (torchrun numbers hosts first)
        self.nnodes = cfg.nnodes
        self.is_owner = self.rank == 0
        cuda = torch.cuda.is_available() and cfg.backend != "gloo"
        if cuda:
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"[train] gpus: local rank {self.local_rank} has no card "
                                   f"({torch.cuda.device_count()} visible)")
            torch.cuda.set_device(self.local_rank)
        self.device = f"cuda:{self.local_rank}" if cuda else "cpu"
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_seconds))
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.setup_timeout_seconds))
        # the host's side of every step (agree, the step's totals): CPU, under the steps' own timeout
        self.host = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_seconds))
        self.others_peak = None
        self._sent = False
        log.info("rank_started", rank=self.rank, world=self.world, local_rank=self.local_rank, node=self.node,
                 backend=backend, device=self.device, pid=os.getpid())

    # ---- what rank 0 hands the others ----------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank (the control group: waits up to setup_timeout_seconds)."""
        import torch.distributed as dist

        box = [obj if self.is_owner else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        if self.is_owner:
            self._sent = True
        return box[0]

    def start(self, params: Sequence[Any]) -> None:
        """Before the first step: wait for every rank (rank 0 may still be evaluating), then take rank 0's
        weights, so every rank starts from the same adapter whatever it loaded."""
        import torch.distributed as dist

        dist.barrier(group=self.control)
        for p in params:
            dist.broadcast(p.data, src=0)

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag true on every rank if true on any (all-reduce MAX), on the host (gloo): asked before every
        step, on the GPU's stream it waited for the step before to finish."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host)
        return [bool(x) for x in t.tolist()]

    def smallest(self, value: int) -> int:
        """The smallest of every rank's value (calibration: the step every card can hold)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- the step -------------------------------------------------------------------------------
    def step(self, model: Any, rows: Sequence[Batch], optimizer: Any, *, device: Any = "cuda",
             max_grad_norm: float | None = 1.0, scheduler: Any = None, params: list[Any] | None = None,
             on_event: Emit = lambda _: None, halve: bool = False) -> StepStat:
        """This rank's row of the global step (none when the step has fewer rows than ranks), backward
        locally (as halves after an out-of-memory), then one all-reduce and the same update on every rank."""
        import torch
        import torch.distributed as dist

        if getattr(optimizer, "in_backward", False):  # every rank has the same optimizer: every rank stops here
            raise ValueError("[train] optimizer_in_backward: the step in the backward pass moves each weight before "
                             "the ranks' gradients are summed; with [train] gpus > 1 set optimizer_in_backward = "
                             'false (or optimizer = "adamw_8bit" to save memory)')
        t0 = time.perf_counter()
        ps = params if params is not None else one_step.trainable(optimizer)
        row = rows[self.rank] if self.rank < len(rows) else None
        share = _Share()
        if row is not None:
            halves = one_step.whole_or_halves(row, lambda: self._contribute(model, row, device, share), optimizer,
                                              halve=halve, on_event=on_event)
            if halves:
                share = _Share(split=True)
                for h in halves:
                    self._contribute(model, h, device, share)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        # the step's label tokens, loss and OOM split over the ranks, on the host (gloo): no wait for the GPU
        n, loss_sum, split = self._host_sum([float(share.tokens), share.loss_sum(), float(share.split)])
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads])
        reached(one_step.BACKWARD)
        dist.all_reduce(flat)  # SUM: exactly one gradient reduction per optimizer step
        reached(REDUCED)
        if n > 0:
            means = flat.div_(n).split([g.numel() for g in grads])
            for p, mean in zip(ps, means, strict=True):  # views of the reduced buffer: no copy a weight
                p.grad = mean.view_as(p) if p.dtype == torch.float32 else mean.view_as(p).to(p.dtype)
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(ps, max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # no synchronize: the reduction and the update run on the GPU while the host queues the next step's forward,
        # as one card's step does (jobs/training/step.py); a caller that times a window synchronises at its end
        return StepStat(sum(b.real_tokens for b in rows), time.perf_counter() - t0, loss_sum / n if n else 0.0,
                        split > 0)

    def _host_sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks on the host (gloo): no GPU stream to wait for."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host)
        return [float(x) for x in t.tolist()]

    @staticmethod
    def _contribute(model: Any, batch: Batch, device: Any, share: _Share) -> None:
        """Backward of the label-token *sum* of the loss (the mean x its tokens): the reduction divides once."""
        n = label_tokens(batch)
        if n == 0:
            return
        out = model(**model_inputs(batch, device, unsloth=is_unsloth(model)))
        loss = one_step.HostLoss(out.loss)  # on its way to the host before the backward is queued
        (out.loss * n).backward()
        share.tokens += n
        share.losses.append((n, loss))

    def finish(self) -> None:
        """After the last step: the other ranks' peak memory, summed, for rank 0's summary (CUDA only)."""
        import torch
        import torch.distributed as dist

        if not self.device.startswith("cuda"):
            return
        mine = [0, 0] if self.is_owner else [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
        t = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        self.others_peak = (int(t[0].item()), int(t[1].item()))

    def release(self) -> None:
        """Rank 0 at the end of its night: if it never handed out a job (nothing to train, a failure), the
        other ranks still wait for one; they get None and leave."""
        if self.is_owner and not self._sent:
            self.broadcast(None)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(cfg: DistributedConfig, environ: Mapping[str, str] | None = None) -> Solo:
    """The group this process belongs to: Solo for one process, else a Group (init_process_group)."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return SOLO
    return Group(cfg, env)
