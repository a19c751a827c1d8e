"""Run one night in a child process and relay what it reports.

The child gets the job sections of the settings on stdin and the deadline on its
command line; its events arrive as JSON lines on its stdout, its log lines on
stderr (passed through, the last ones kept for a failure report). A stop request
sends SIGTERM, waits the grace for the checkpoint, then SIGKILLs.

Several processes (`[train] gpus`, jobs/training/ranks/topology.py): the child is torchrun, which starts
the ranks; the config goes in a file (every worker shares torchrun's stdin), torchrun forwards
SIGTERM to every rank, each rank dies with it if it is SIGKILLed, and the outcome is rank 0's
result event (torchrun's own exit status is only 0 or 1).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import structlog

from daemon import sdnotify
from jobs.contract import ChildEvent, ExitCode, ResultEvent, RunSummary, new_run_id, parse_event
from jobs.runtime import logs
from jobs.store.ledger import Ledger
from jobs.store.locking import LOCK_FD_ENV
from jobs.store.stale import expired
from jobs.training.config import TrainConfig
from jobs.training.ranks.topology import World, launch_command, launch_env, resolve_world, visible_gpus

log = structlog.get_logger("nightshift.supervisor")
# after the child's exit, how long the event reader may still take to hand on what the child wrote (it ends at the
# pipe's end, or once the night's result is handled): only a descendant holding the pipe open reaches it
READER_BOUND_SECONDS = 120.0


def child_env() -> dict[str, str]:
    """The environment of every torch child: offline (nothing from a hub), no systemd variables."""
    return {**sdnotify.child_environ(), **logs.child_log_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_id_for(ledger: Ledger, night: str) -> str:
    """The id tonight's run will have: the one a crash or stop left open (the child resumes it), or a new one."""
    run = ledger.open_run(night)
    resumable = run is not None and not expired(run, time.time())  # else the child closes it (jobs/store/stale.py)
    return str(run["id"]) if run is not None and resumable else new_run_id(night)


def night_world(train: TrainConfig) -> World:
    """The processes of tonight's child on this host (ValueError: `[train] gpus` asks for more cards than
    there are)."""
    return resolve_world(train.gpus, train.devices, train.distributed, visible_gpus())


@dataclass
class ChildOutcome:
    returncode: int
    summary: RunSummary | None
    tail: list[str] = field(default_factory=list)
    launcher: bool = False  # torchrun's exit status: 0 or 1 whatever the ranks returned

    @property
    def crashed(self) -> bool:
        if self.launcher:  # rank 0's result event is the outcome
            return self.summary is None
        return self.summary is None or self.returncode not in (ExitCode.OK, ExitCode.INTERRUPTED)

    def describe_exit(self) -> str:
        if self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        if self.launcher:
            return f"the torchrun group failed (exit status {self.returncode}: a rank died or failed; see its log)"
        return f"exit status {self.returncode}"


class NightChild:
    def __init__(self, night_config_json: str, *, night: str, deadline: float,
                 on_event: Callable[[ChildEvent], None] = lambda _: None, plan_only: bool = False,
                 log_stream: TextIO | None = None, tail_lines: int = 40, lock_fd: int | None = None,
                 run_id: str | None = None, world: World | None = None, train: TrainConfig | None = None,
                 grace: float | None = None, join: bool = False, start_at: float | None = None) -> None:
        """`run_id`: the id a new run gets (the caller logs under it; a run left open keeps its own).
        `start_at` (unix seconds): the window's opening, ahead: the child imports its libraries, then waits."""
        self.lock_fd = lock_fd  # the night lock the child inherits: held while it lives, even if we die
        self.config_json = night_config_json
        # [distributed] one process unless `world` says more (a plan is always one process)
        self.world = world if world is not None and not plan_only else World(nproc=1, cuda_visible=None)
        self.train, self.grace, self.join = train or TrainConfig(), grace, join
        self._config_file: str | None = None
        self.night, self.deadline, self.plan_only, self.run_id = night, deadline, plan_only, run_id
        self.start_at = start_at
        self.on_event = on_event
        self.log_stream = log_stream or sys.stderr
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.summary: RunSummary | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._result_handled = threading.Event()

    def start(self) -> int:
        args = ["--join"] if self.join else ["--night", self.night, "--deadline", repr(self.deadline)]
        if self.plan_only:
            args.append("--plan-only")
        if self.run_id and not self.join:
            args += ["--run-id", self.run_id]
        if self.start_at is not None and not self.join:
            args += ["--start-at", repr(self.start_at)]
        if self.world.launcher:  # every torchrun worker shares stdin: the config goes as a file (0600)
            fd, self._config_file = tempfile.mkstemp(prefix="nightshift-night-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(self.config_json)
            args += ["--config", self._config_file]
        cmd = launch_command(self.world, self.train.distributed, "jobs.night.child", args)
        env = {**child_env(), **launch_env(self.world, grace_seconds=self.grace)}
        env.setdefault("NIGHTSHIFT_LOG_FORMAT", "console" if self.log_stream.isatty() else "json")
        if self.lock_fd is not None:  # under torchrun the launcher holds it; its rank 0 checks (jobs/night/child.py)
            env[LOCK_FD_ENV] = str(self.lock_fd)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL if self._config_file else subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=True,  # our SIGINT is not its SIGINT
                                     pass_fds=() if self.lock_fd is None else (self.lock_fd,))
        if self._config_file is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(self.config_json.encode())
            self.proc.stdin.close()
        # the readers log (and call on_event) with the caller's context: its run_id is on their lines too
        self._threads = [threading.Thread(target=contextvars.copy_context().run, args=(f,), daemon=True)
                         for f in (self._read_events, self._read_logs)]
        for t in self._threads:
            t.start()
        log.info("child_started", pid=self.proc.pid, night=self.night, plan_only=self.plan_only,
                 processes=self.world.nproc, nnodes=self.world.nnodes)
        return self.proc.pid

    def _read_events(self) -> None:
        assert self.proc and self.proc.stdout
        for raw in self.proc.stdout:
            try:
                ev = parse_event(raw)
            except ValueError as e:  # validated here, where the pipe is read: never passed on half-typed
                self.tail.append(raw.decode(errors="replace").rstrip()[:500])
                log.warning("bad_child_event", error=str(e))
                continue
            night_result = isinstance(ev, ResultEvent) and not ev.adapter  # [[adapters]]: one adapter's is not it
            if night_result:
                self.summary = ev.summary
            try:
                self.on_event(ev)
            except Exception:  # a metrics bug, or a reader gone (`once | head -1`), must not stop the reading
                log.exception("event_handler_failed", child_event=ev.event)  # `event` is structlog's own
            finally:
                if night_result:
                    self._result_handled.set()

    def _read_logs(self) -> None:
        assert self.proc and self.proc.stderr
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            try:
                self.log_stream.write(line + "\n")
                self.log_stream.flush()
            except (ValueError, OSError):
                pass

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request_stop(self) -> None:
        if self.running():
            assert self.proc is not None
            log.info("child_stop_requested", pid=self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float) -> ChildOutcome:
        """SIGTERM, wait `grace` seconds for the checkpoint, then SIGKILL."""
        self.request_stop()
        try:
            return self.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            assert self.proc is not None
            log.warning("child_killed_after_grace", pid=self.proc.pid, grace=grace)
            self.proc.kill()
            return self.wait()

    def wait(self, timeout: float | None = None) -> ChildOutcome:
        assert self.proc is not None
        rc = self.proc.wait(timeout=timeout)
        self._join_readers(READER_BOUND_SECONDS if rc >= 0 else 5.0)  # killed: it wrote no result
        if self._config_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._config_file)
            self._config_file = None
        return ChildOutcome(rc, self.summary, list(self.tail), launcher=self.world.launcher)

    def _join_readers(self, bound: float) -> None:
        """Everything the child wrote before it exited is handed on, its result among them: with the reader given 5 s,
        a handler slower than that (a blocked terminal, sd_notify) could leave the result unread, and a night that
        succeeded would be counted failed. The log reader gets 5 s: its lines are also in the night's log file."""
        if not self._threads:
            return
        events, *others = self._threads
        end = time.monotonic() + bound
        while events.is_alive() and not self._result_handled.is_set() and time.monotonic() < end:
            events.join(timeout=0.1)
        for t in others:
            t.join(timeout=5)


def wait_interruptibly(child: NightChild, stop: threading.Event, grace: float, poll: float = 0.2,
                       on_tick: Callable[[], None] = lambda: None, stop_at: float | None = None,
                       clock: Callable[[], float] = time.time) -> ChildOutcome:
    """Wait for the child. When `stop` is set, or at `stop_at` (the window's end, unix seconds), stop it:
    SIGTERM, `grace` seconds to checkpoint and save, then SIGKILL. `on_tick` runs every poll (watchdog)."""
    while child.running():
        if stop.wait(poll) or (stop_at is not None and clock() >= stop_at):
            return child.stop(grace)
        on_tick()
    return child.wait()
