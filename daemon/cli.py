"""The `nightshift` command line."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from daemon import capture_cli, config_cli, report, report_cli, several_view, terminal, validate_cli
from daemon.adapters_cli import add_commands as add_adapter_commands
from daemon.cli_help import DESCRIPTION, CommandParser, exit_codes_help
from daemon.doctor import add_command as add_doctor_command
from daemon.lineage import lineage_notes
from daemon.notify import Notifier
from daemon.preflight import before_a_night, one_line
from daemon.progress import NightProgress, choose_mode, relay
from daemon.settings import ConfigError, Settings, check_paths, load_settings
from daemon.supervisor import NightChild, child_env, night_world, run_id_for, wait_interruptibly
from daemon.window import Window, parse_until, until_arg
from jobs.contract import (
    ChildEvent,
    ExitCode,
    Outcome,
    Phase,
    PhaseEvent,
    PlanEvent,
    RunSummary,
    SharesEvent,
    nightshift_version,
    outcome_exit_code,
)
from jobs.store.ledger import Ledger
from jobs.store.outcomes import NightOutcomes
from jobs.store.paths import StatePaths
from jobs.store.stale import fate


def window_seconds(s: Settings) -> float:
    return s.window.length.total_seconds()


def run_child(s: Settings, *, night: str, deadline: float, plan_only: bool,
              on_event=lambda _: None, lock_fd: int | None = None, run_id: str | None = None,
              stop_at: float | None = None) -> Any:
    """`stop_at`: the window's end (unix seconds): the child is stopped then as the service stops it
    (SIGTERM, [daemon] stop_grace_seconds to save, SIGKILL), so no night outlives its window."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = NightChild(s.night_config().model_dump_json(), night=night, deadline=deadline,
                           plan_only=plan_only, on_event=on_event, lock_fd=lock_fd, run_id=run_id,
                           world=None if plan_only else night_world(s.train), train=s.train,
                           grace=s.daemon.stop_grace_seconds, log_stream=terminal.child_log_stream())
        child.start()
        return wait_interruptibly(child, stop, grace=s.daemon.stop_grace_seconds, stop_at=stop_at)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def manual_window(args: argparse.Namespace, s: Settings) -> Window:
    """`once` and `plan`: a window from now to --until (default: the configured window's length)."""
    now = dt.datetime.now().astimezone()
    end = parse_until(args.until, window_seconds(s), now)
    return Window(night=f"manual-{now.date().isoformat()}", start=now.astimezone(dt.UTC),
                  end=dt.datetime.fromtimestamp(end, dt.UTC))


def no_time_to_train(window: Window, s: Settings) -> str | None:
    """Why a manual window leaves no time to train (training stops `save_margin_minutes` before its end), or None."""
    left = (window.end - window.start).total_seconds()
    margin = s.window.save_margin.total_seconds()
    if left > margin:
        return None
    return (f"the window ends in {left / 60:.1f} min ({window.end.astimezone():%H:%M:%S}), not more than "
            f"[window] save_margin_minutes ({s.window.save_margin_minutes:g}), the time kept to save before the end: "
            "no time to train. Give a later --until or a smaller save_margin_minutes.")


def not_node_0(s: Settings, command: str) -> int | None:
    """[distributed] only node 0 runs nights; on another host, or with more cards asked than there are:
    the exit status of the refusal."""
    if not s.train.distributed.owner:
        print(f"nightshift {command}: this host is node {s.train.distributed.node_rank} of "
              f"[train.distributed]: it joins node 0's nights with `nightshift join`", file=sys.stderr)
        return 2
    try:
        night_world(s.train)
    except ValueError as e:
        print(f"nightshift {command}: {e}", file=sys.stderr)
        return 2
    return None


def cmd_once(args: argparse.Namespace, s: Settings) -> int:
    if (refused := not_node_0(s, "once")) is not None:
        return refused
    with before_a_night(s, args.config, "nightshift once") as lock:  # paths, disk, one night at a time, ledger
        return _once(args, s, lock.fd)


def _once(args: argparse.Namespace, s: Settings, lock_fd: int | None) -> int:
    window = manual_window(args, s)
    if (no_time := no_time_to_train(window, s)) is not None:
        print(f"nightshift once: {no_time}", file=sys.stderr)
        return 2
    ledger = Ledger(StatePaths(s.state_dir).ledger)
    try:
        run_id = run_id_for(ledger, window.night)
        with structlog.contextvars.bound_contextvars(run_id=run_id, night=window.night):
            return _run_once(args, s, window, ledger, run_id, lock_fd)
    finally:
        ledger.close()


def _run_once(args: argparse.Namespace, s: Settings, window: Window, ledger: Ledger, run_id: str,
              lock_fd: int | None) -> int:
    night, deadline = window.night, window.end.timestamp()
    with NightProgress(choose_mode(log_format=s.log.format)) as progress:
        def show(ev: ChildEvent) -> None:
            if isinstance(ev, PlanEvent):
                title = f"plan of adapter {ev.adapter}" if ev.adapter else "plan"
                progress.print(f"{title}:\n" + report.plan_table(ev.plan) + "\n")
            elif isinstance(ev, SharesEvent):  # [[adapters]]: before anything trains
                progress.print("the window, shared by the adapters:\n" + several_view.shares_table(ev.shares) + "\n")
            progress.on_event(ev)

        out = run_child(s, night=night, deadline=window.deadline(s.window.save_margin).timestamp(),
                        plan_only=False, on_event=show, lock_fd=lock_fd, run_id=run_id, stop_at=deadline)
    summary, closed_as = out.summary, None
    if summary is None or summary.outcome == Outcome.failed:
        # one attempt for a manual night: close it (a killed `once` leaves it open, and a rerun resumes)
        error = (summary.error if summary else None) or f"the night's process died ({out.describe_exit()})"
        closed = NightOutcomes(ledger).close(night, "failed", error, deadline=deadline)
        row = ledger.run(closed)  # a run killed after promoting its version closes as succeeded
        closed_as = row["status"]
        summary = summary or RunSummary(run_id=closed, night=night, outcome=row["status"], error=row["error"])
    if summary.outcome != Outcome.interrupted:
        Notifier(s.hotswap, ledger).night_closed(summary)
    if out.summary is None:
        print(f"nightshift once: the night's process failed ({out.describe_exit()}); last lines:", file=sys.stderr)
        print("\n".join(out.tail[-15:]), file=sys.stderr)
        return 1
    price = s.gpu.price_per_gpu_hour
    for each in out.summary.adapters:  # [[adapters]]: each adapter's night, then the table of all
        print(f"adapter {each.adapter}:\n" + report.summary_table(each, price) + "\n")
    print("night:\n" + (several_view.adapters_table(out.summary.adapters) if out.summary.adapters
                        else report.summary_table(out.summary, price)))
    if getattr(args, "log_file", None):
        print(f"\nthe night's log: {args.log_file}")
    if out.summary.outcome == Outcome.failed:
        print(f"nightshift once: failed: {out.summary.error}", file=sys.stderr)
        if closed_as == Outcome.succeeded:  # closed above: its version was promoted before the failure
            print(f"nightshift once: its version {out.summary.version_name or ''} was promoted before that and is "
                  "in service (`nightshift status`); the ledger records the night succeeded", file=sys.stderr)
    if out.summary.outcome == Outcome.interrupted and (row := ledger.run(out.summary.run_id or "")) is not None \
            and row["status"] == "running":  # what comes of it, as `status` says it
        print(f"nightshift once: stopped; {fate(row, time.time(), night_running=False)}", file=sys.stderr)
    code = outcome_exit_code(out.summary.outcome)
    if code == ExitCode.OK and (failed := report.hotswap_failures(out.summary)):  # README: published, not taken
        print(f"nightshift once: published, but not every inference server took it: {'; '.join(failed)}. "
              "`nightshift hotswap` re-sends it once the server is up", file=sys.stderr)
        return ExitCode.HOTSWAP_FAILED
    return code


def plan_events(progress: NightProgress) -> Any:
    """A plan's progress without "pull: started / done": it reads the inboxes and pulls nothing."""
    def show(ev: ChildEvent) -> None:
        if not (isinstance(ev, PhaseEvent) and ev.phase == Phase.pull):
            progress.on_event(ev)
    return show


def cmd_plan(args: argparse.Namespace, s: Settings) -> int:
    # the night `once` would run, with its name (the replay draw is seeded by it) and its training deadline
    # (the window's end less the save margin): the plan shows the figures `once` will have (52 vs 45 replayed
    # samples when the plan was seeded "plan" and timed to the window's very end)
    window = manual_window(args, s)
    if (no_time := no_time_to_train(window, s)) is not None:  # what `once` says to the same --until
        print(f"nightshift plan: {no_time}", file=sys.stderr)
        return 2
    night, deadline = window.night, window.deadline(s.window.save_margin).timestamp()
    problems = check_paths(s, writes=False)  # no lock, no write: also while a night runs, and as another user
    if problems:
        raise ConfigError(args.config, problems)
    with NightProgress(choose_mode(json_output=args.json, log_format=s.log.format)) as progress:
        out = run_child(s, night=night, deadline=deadline, plan_only=True, on_event=plan_events(progress))
    if out.summary is not None and out.summary.adapters:
        return _plan_of_adapters(args, out.summary)
    if out.summary is None or out.summary.plan is None:
        if out.summary is not None and out.summary.error:  # the child's one line (damaged state, a missing path)
            print(f"nightshift plan: refused: {out.summary.error}", file=sys.stderr)
            return 1
        print(f"nightshift plan: failed ({out.describe_exit()})", file=sys.stderr)
        print("\n".join(out.tail[-15:]), file=sys.stderr)
        return 1
    inbox = report.inbox_preview(out.summary)
    if args.json:
        print(json.dumps({**out.summary.plan.model_dump(mode="json"), "inbox": inbox}, indent=2))
    else:
        print(report.plan_table(out.summary.plan) + "\n\n" + report.inbox_table(inbox))
    return 0


def _plan_of_adapters(args: argparse.Namespace, summary: RunSummary) -> int:
    """[[adapters]]: the window's shares, then each adapter's own plan within its slice."""
    if args.json:
        print(json.dumps({"shares": [x.model_dump(mode="json") for x in summary.shares],
                          "adapters": {a.adapter: a.plan.model_dump(mode="json") if a.plan else {"error": a.error}
                                       for a in summary.adapters}}, indent=2))
        return 0
    print("the window, shared by the adapters:\n" + several_view.shares_table(summary.shares))
    for a in summary.adapters:
        print(f"\nplan of adapter {a.adapter}:\n" + (report.plan_table(a.plan) if a.plan else f"none: {a.error}"))
    return 0 if all(a.plan is not None for a in summary.adapters) else 1


def cmd_check_config(args: argparse.Namespace, s: Settings) -> int:
    """Types (every wrong key, from the file and the environment) were checked when loading; then paths."""
    problems = check_paths(s)
    if problems:
        print(str(ConfigError(args.config, problems)), file=sys.stderr)
        return 2
    for note in lineage_notes(s):
        print(f"note: {note}", file=sys.stderr)
    print(f"{args.config}: OK")
    return 0


def cmd_run(args: argparse.Namespace, s: Settings) -> int:
    """Everything a user can get wrong is refused here, before READY: systemd sees the start fail."""
    from daemon.service import Service

    if (refused := not_node_0(s, "run")) is not None:
        return refused
    problems = check_paths(s)
    if problems:
        raise ConfigError(args.config, problems)
    return Service(s).run()


def cmd_status(args: argparse.Namespace, s: Settings) -> int:
    from daemon.status import collect, render

    info = {"config": f"{args.config} ({args.config_how})", **collect(s)}
    print(json.dumps(info, indent=2, default=str) if args.json else render(info))
    return 0


def cmd_join(args: argparse.Namespace, s: Settings) -> int:
    from daemon.join import join

    return join(s, once=args.once)


def cmd_calibrate(args: argparse.Namespace, s: Settings) -> int:
    """Our own GPU path, measured in a child process and recorded for the planner; with `[train] gpus` > 1
    through torchrun, measured for that count of cards (this host's: hosts of [train.distributed] aside)."""
    from daemon.calibrate_launch import calibrate_command

    if (refused := not_node_0(s, "calibrate")) is not None:
        return refused
    out = args.out or StatePaths(s.state_dir).calibrate
    with before_a_night(s, args.config, "nightshift calibrate") as lock:  # the GPU and the ledger: one at a time
        extra = ["--no-checkpointing-line"] if args.no_checkpointing_line else []
        with calibrate_command(s, out=out, seconds=args.seconds, extra=extra) as (cmd, env, stdin):
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, text=True, env={**child_env(), **env},
                                    pass_fds=(lock.fd,) if lock.fd is not None else ())
            assert proc.stdout is not None
            if stdin is not None:
                assert proc.stdin is not None
                proc.stdin.write(stdin)
                proc.stdin.close()
            with NightProgress(choose_mode(log_format=s.log.format)) as progress:
                relay(proc.stdout, progress)  # phase and progress events; the measurement's JSON is printed as is
            return proc.wait()


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(prog="nightshift", description=DESCRIPTION, epilog=exit_codes_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"nightshift {nightshift_version()}")
    ap.add_argument("--config", type=Path, default=None, help=config_cli.SEARCH_HELP)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = sub.add_parser("once", help="run one night now")
    p.add_argument("--until", metavar="HH:MM[:SS]|+N", type=until_arg,
                   help="when the window closes: local time, or +N s/min/h from now (+30min); the night stops by "
                   "then (default: now + the configured window's length)")
    p.set_defaults(func=cmd_once)
    p = sub.add_parser("plan", help="print tonight's plan over the pending samples and what the inbox would add; "
                       "changes nothing")
    p.add_argument("--until", metavar="HH:MM[:SS]|+N", type=until_arg,
                   help="when the window closes: local time, or +N s/min/h from now (default: now + window length)")
    p.add_argument("--json", action="store_true", help="the plan as JSON (no progress display)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("run", help="the service: wait for each night's window and run it (systemd)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("join", help="a host other than node 0 of [train.distributed]: train node 0's nights")
    p.add_argument("--once", action="store_true", help="join one night (or one attempt), then exit")
    p.set_defaults(func=cmd_join)
    p = sub.add_parser("status", help="config used, next window, last runs, backlog, adapter in service")
    p.add_argument("--json", action="store_true", help="the same as JSON")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("check-config", help="report every problem of a config file")
    p.add_argument("file", type=Path, nargs="?", metavar="FILE", help="the file to check (default: as --config)")
    p.set_defaults(func=cmd_check_config)
    validate_cli.add_command(sub)
    config_cli.add_command(sub)
    report_cli.add_command(sub)
    p = sub.add_parser("calibrate", help="measure our training path on this GPU and record it for the planner")
    p.add_argument("--out", type=Path, help="where the measurement's JSON goes (default: <state_dir>/calibrate)")
    p.add_argument("--seconds", type=float, default=30.0, help="timed seconds per length profile")
    p.add_argument("--no-checkpointing-line", action="store_true",
                   help="skip reloading the model to measure the checkpointing line (the night estimates it)")
    p.set_defaults(func=cmd_calibrate)
    add_adapter_commands(sub)
    capture_cli.add_command(sub)
    add_doctor_command(sub)
    accept_config_after_the_command(ap)
    return ap


def accept_config_after_the_command(parser: argparse.ArgumentParser) -> None:
    """`nightshift run --config F` (as the systemd unit writes it) as well as `nightshift --config F run`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=config_cli.SEARCH_HELP)
                accept_config_after_the_command(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "check-config" and args.file is not None:
        args.config = args.file
    needs = getattr(args, "needs_settings", None)
    if needs is not None and not needs(args):
        return one_line(args.cmd, lambda: args.func(args, None))  # `config --schema | head -1` too
    try:
        args.config, args.config_how = config_cli.resolve_config_path(args.config)
        s = load_settings(args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    args.log_file = terminal.route_logs(args.cmd, s)  # at a TTY: one stream, the log to a file (daemon/terminal.py)
    return one_line(args.cmd, lambda: args.func(args, s))


if __name__ == "__main__":
    sys.exit(main())
