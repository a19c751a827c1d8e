"""sd_notify over a real unix datagram socket (path and abstract namespace); no-op without one."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon import sdnotify


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2)
        yield sock, {"NOTIFY_SOCKET": str(path)}


def test_messages(listener: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = listener
    assert sdnotify.ready(environ=env)
    assert recv(sock) == "READY=1"
    assert sdnotify.ready("waiting for window 01:00–06:00 Europe/Berlin", environ=env)
    assert recv(sock) == "READY=1\nSTATUS=waiting for window 01:00–06:00 Europe/Berlin"
    assert sdnotify.status("training v0007: 41 %\n1.2 M tokens", environ=env)
    assert recv(sock) == "STATUS=training v0007: 41 % 1.2 M tokens"  # one line
    assert sdnotify.watchdog(environ=env)
    assert recv(sock) == "WATCHDOG=1"
    assert sdnotify.stopping("saving the adapter", environ=env)
    assert recv(sock) == "STOPPING=1\nSTATUS=saving the adapter"


def test_reads_os_environ_by_default(
    listener: tuple[socket.socket, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, env = listener
    monkeypatch.setenv("NOTIFY_SOCKET", env["NOTIFY_SOCKET"])
    assert sdnotify.watchdog()
    assert recv(sock) == "WATCHDOG=1"


def test_abstract_namespace() -> None:
    name = f"nightshift-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert sdnotify.ready(environ={"NOTIFY_SOCKET": "@" + name})
        assert recv(sock) == "READY=1"


def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.status("x") is False
    assert sdnotify.watchdog(environ={"NOTIFY_SOCKET": ""}) is False
    assert sdnotify.stopping(environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False  # not spoken here


def test_a_dead_socket_does_not_raise(tmp_path: Path) -> None:
    assert sdnotify.watchdog(environ={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "120000000"}, 60.0),
        ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": str(os.getpid())}, 60.0),
        ({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert sdnotify.watchdog_interval(environ=env) == expected


def test_child_environ_drops_the_notify_variables() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert sdnotify.child_environ(env) == {"PATH": "/bin"}
