"""The `nightshift` command line."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from daemon import report
from daemon.adapters_cli import add_commands as add_adapter_commands
from daemon.settings import DEFAULT_CONFIG, ConfigError, Settings, check_paths, load_settings
from daemon.supervisor import NightChild, child_env, night_world, wait_interruptibly
from daemon.window import Window
from jobs import logs
from jobs.contract import ChildEvent, Outcome, PlanEvent, outcome_exit_code
from jobs.store.ledger import Ledger
from jobs.store.outcomes import NightOutcomes


def parse_until(until: str | None, default_seconds: float, now: dt.datetime) -> float:
    """--until HH:MM (local time, the next such moment) or now + default; unix seconds."""
    if until is None:
        return now.timestamp() + default_seconds
    try:
        h, m = (int(x) for x in until.split(":"))
        t = now.replace(hour=h, minute=m, second=0, microsecond=0)
    except ValueError:
        raise SystemExit(f"--until: expected HH:MM, got {until!r}") from None
    if t <= now:
        t += dt.timedelta(days=1)
    return t.timestamp()


def window_seconds(s: Settings) -> float:
    return s.window.length.total_seconds()


def run_child(s: Settings, *, night: str, deadline: float, plan_only: bool,
              on_event=lambda _: None) -> Any:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = NightChild(s.night_config().model_dump_json(), night=night, deadline=deadline,
                           plan_only=plan_only, on_event=on_event,
                           world=None if plan_only else night_world(s.train), train=s.train,
                           grace=s.daemon.stop_grace_seconds)
        child.start()
        return wait_interruptibly(child, stop, grace=s.daemon.stop_grace_seconds)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def manual_window(args: argparse.Namespace, s: Settings) -> Window:
    """`once` and `plan`: a window from now to --until (default: the configured window's length)."""
    now = dt.datetime.now().astimezone()
    end = parse_until(args.until, window_seconds(s), now)
    return Window(night=f"manual-{now.date().isoformat()}", start=now.astimezone(dt.UTC),
                  end=dt.datetime.fromtimestamp(end, dt.UTC))


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
    window = manual_window(args, s)
    night, deadline = window.night, window.end.timestamp()

    def show_plan(ev: ChildEvent) -> None:
        if isinstance(ev, PlanEvent):
            print("plan:\n" + report.plan_table(ev.plan) + "\n", flush=True)

    out = run_child(s, night=night, deadline=window.deadline(s.window.save_margin).timestamp(), plan_only=False,
                    on_event=show_plan)
    if out.summary is None or out.summary.outcome == Outcome.failed:
        # one attempt for a manual night: close it (a killed `once` leaves it open, and a rerun resumes)
        error = (out.summary.error if out.summary else None) or f"the night's process died ({out.describe_exit()})"
        ledger = Ledger(s.state_dir / "ledger.sqlite")
        NightOutcomes(ledger).close(night, "failed", error, deadline=deadline)
        ledger.close()
    if out.summary is None:
        print(f"nightshift once: the night's process failed ({out.describe_exit()}); last lines:", file=sys.stderr)
        print("\n".join(out.tail[-15:]), file=sys.stderr)
        return 1
    print("night:\n" + report.summary_table(out.summary))
    return outcome_exit_code(out.summary.outcome)


def cmd_plan(args: argparse.Namespace, s: Settings) -> int:
    now = dt.datetime.now().astimezone()
    deadline = parse_until(args.until, window_seconds(s), now)
    out = run_child(s, night="plan", deadline=deadline, plan_only=True)
    if out.summary is None or out.summary.plan is None:
        print(f"nightshift plan: failed ({out.describe_exit()})", file=sys.stderr)
        print("\n".join(out.tail[-15:]), file=sys.stderr)
        return 1
    if args.json:
        print(out.summary.plan.model_dump_json(indent=2))
    else:
        print(report.plan_table(out.summary.plan))
    return 0


def cmd_check_config(args: argparse.Namespace, s: Settings) -> int:
    problems = check_paths(s)
    if problems:
        print(str(ConfigError(args.config, problems)), file=sys.stderr)
        return 2
    print(f"{args.config}: OK")
    return 0


def cmd_run(args: argparse.Namespace, s: Settings) -> int:
    from daemon.service import Service

    if (refused := not_node_0(s, "run")) is not None:
        return refused

    return Service(s).run()


def cmd_status(args: argparse.Namespace, s: Settings) -> int:
    from daemon.status import collect, render

    info = collect(s)
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
    out = args.out or Path(s.state_dir) / "calibrate"
    with calibrate_command(s, out=out, seconds=args.seconds) as (cmd, env, stdin):
        return subprocess.run(cmd, input=stdin, text=True, env={**child_env(), **env}).returncode


def cmd_bench(args: argparse.Namespace, s: Settings) -> int:
    """The side-by-side benchmark (jobs/bench/) in a child process; arguments pass through."""
    cmd = [sys.executable, "-m", "jobs.bench", "bench", *args.bench_args]
    return subprocess.run(cmd, env=child_env()).returncode


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nightshift", description=__doc__)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="TOML file (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("once", help="run one night now")
    p.add_argument("--until", help="HH:MM local time the window closes (default: now + window length)")
    p.set_defaults(func=cmd_once)
    p = sub.add_parser("plan", help="pull and print tonight's plan; trains nothing")
    p.add_argument("--until", help="HH:MM (default: now + window length)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("run", help="the service: wait for each night's window and run it (systemd)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("join", help="a host other than node 0 of [train.distributed]: train node 0's nights")
    p.add_argument("--once", action="store_true", help="join one night (or one attempt), then exit")
    p.set_defaults(func=cmd_join)
    p = sub.add_parser("status", help="next window, last runs, backlog, adapter in service")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("check-config", help="report every problem of a config file")
    p.add_argument("file", type=Path, nargs="?")
    p.set_defaults(func=cmd_check_config)
    p = sub.add_parser("calibrate", help="measure our training path on this GPU and record it for the planner")
    p.add_argument("--out", type=Path, help="where the measurement's JSON goes (default: <state_dir>/calibrate)")
    p.add_argument("--seconds", type=float, default=30.0, help="timed seconds per length profile")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("bench", help="GPU benchmark: baseline, Unsloth, Unsloth+TRL and ours, side by side "
                       "(its own options follow: `nightshift bench --help`)", add_help=False)
    p.set_defaults(func=cmd_bench)
    add_adapter_commands(sub)
    accept_config_after_the_command(ap)
    return ap


def accept_config_after_the_command(parser: argparse.ArgumentParser) -> None:
    """`nightshift run --config F` (as the systemd unit writes it) as well as `nightshift --config F run`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if sub.get_default("func") is not cmd_bench:  # the benchmark passes its arguments through
                    sub.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML file")
                accept_config_after_the_command(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "bench":
        args.bench_args = extra  # the benchmark has its own options (jobs/bench/)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "check-config" and args.file is not None:
        args.config = args.file
    try:
        s = load_settings(args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    logs.configure(s.log.level, None if s.log.format == "auto" else s.log.format)
    return args.func(args, s)


if __name__ == "__main__":
    sys.exit(main())
