"""systemd notify protocol (sd_notify(3)): a few lines over a unix datagram socket.

No dependency: the protocol is "send `KEY=value` lines as one datagram to $NOTIFY_SOCKET"
(a path, or "@name" for the abstract namespace). Without NOTIFY_SOCKET (not under
systemd, or Type=simple) every call is a no-op that returns False, so the daemon calls
these unconditionally. A failed send is logged and returns False, never raises: a
notification is not worth crashing the service for (a missed WATCHDOG=1 is what
systemd acts on, and it will).

`environ` parameters exist for tests; the default is os.environ.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("nightshift.sdnotify")
_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _address(environ: Mapping[str, str]) -> str | None:
    addr = environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]  # abstract namespace
    if addr.startswith("/"):
        return addr
    return None  # unset, empty, or a transport we do not speak (e.g. vsock:)


def notify(*assignments: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `KEY=value` assignments in one datagram. True if sent."""
    env = os.environ if environ is None else environ
    addr = _address(env)
    if addr is None:
        return False
    payload = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(payload)
    except OSError as e:
        log.warning("sd_notify failed", socket=env.get("NOTIFY_SOCKET"), error=str(e))
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())  # STATUS is one line: a newline would start a new assignment


def ready(status: str | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """READY=1: start-up finished (Type=notify units are 'activating' until then)."""
    extra = [f"STATUS={_one_line(status)}"] if status else []
    return notify("READY=1", *extra, environ=environ)


def status(text: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """STATUS=...: the free-form line `systemctl status` shows."""
    return notify(f"STATUS={_one_line(text)}", environ=environ)


def watchdog(*, environ: Mapping[str, str] | None = None) -> bool:
    """WATCHDOG=1: 'the main loop is alive'; send every watchdog_interval() seconds."""
    return notify("WATCHDOG=1", environ=environ)


def stopping(status: str | None = None, *, environ: Mapping[str, str] | None = None) -> bool:
    """STOPPING=1: shutdown has begun (saving may take a while)."""
    extra = [f"STATUS={_one_line(status)}"] if status else []
    return notify("STOPPING=1", *extra, environ=environ)


def watchdog_interval(*, environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when the watchdog is off: WATCHDOG_USEC unset/invalid, or WATCHDOG_PID names
    another process (the variables leaked to a child).
    """
    env = os.environ if environ is None else environ
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


def child_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without the notify variables, for child processes.

    Only the main process talks to systemd (NotifyAccess=main); a child that inherited
    NOTIFY_SOCKET could confuse a library that speaks the protocol by itself.
    """
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in _VARS}
