"""`nightshift join`: a host other than node 0 lends its cards to node 0's nights.

Node 0 (`[train.distributed] node_rank = 0`) runs the service: it owns the ledger, the plan, the
registry and publication, and its night's torchrun hosts the rendezvous at `rdzv_endpoint`. Every
other host runs `nightshift join` with the same `[train]` and its own `node_rank`: it keeps one
torchrun launcher waiting at that rendezvous; when node 0's night starts, its ranks join, receive
their share of the night from rank 0 (the training data, the step shape, the adapter to start from,
the deadline), train, and the launcher starts waiting again for the next night (or the retry of this
one). Nothing is written to this host's ledger; its state_dir holds only scratch files and caches.

It speaks sd_notify like `nightshift run` (READY, watchdog pings, STOPPING), so the same systemd unit
runs it with `join` in place of `run`.
"""

from __future__ import annotations

import signal
import threading

import structlog

from daemon import sdnotify
from daemon.settings import Settings
from daemon.supervisor import NightChild, night_world, wait_interruptibly
from jobs.contract import ExitCode

log = structlog.get_logger("nightshift.join")


def join(s: Settings, *, once: bool = False, pause: float = 5.0) -> int:
    dist = s.train.distributed
    if dist.owner:
        log.error("join_refused", reason="[train.distributed] node_rank is 0: this host runs the nights "
                  "(`nightshift run`); the other hosts join them")
        return ExitCode.USAGE
    try:
        world = night_world(s.train)
    except ValueError as e:
        log.error("join_refused", reason=str(e))
        return ExitCode.USAGE
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    config = s.night_config().model_dump_json()
    sdnotify.ready(f"joining the nights of {dist.rdzv_endpoint} as node {dist.node_rank}")
    while not stop.is_set():
        log.info("join_waiting", endpoint=dist.rdzv_endpoint, node_rank=dist.node_rank, processes=world.nproc)
        child = NightChild(config, night="join", deadline=0.0, world=world, train=s.train, join=True,
                           grace=s.daemon.stop_grace_seconds)
        child.start()
        out = wait_interruptibly(child, stop, grace=s.daemon.stop_grace_seconds, on_tick=sdnotify.watchdog)
        log.info("join_ended", returncode=out.returncode)
        if once:
            return ExitCode.OK if out.returncode == 0 else ExitCode.FAILED
        stop.wait(pause)  # node 0 not there yet, or its night failed: wait for the next one
    sdnotify.stopping("stopping")
    return ExitCode.OK
