"""A crash at every write point of the operator's commands (issue 40): `nightshift adapters promote`,
`rollback`, `pin`, `unpin` and `prune`, each SIGKILLed (jobs/contract/crashpoints.py) at every durable step
in turn, then the same command run again.

After the kill: `current` is on a verified version, and where it is not yet the one the ledger says is in
service (a promote or rollback cut between its ledger record and the swap), that one verifies, so
re-running the command or the next night moves `current` to it; `nightshift doctor` reports nothing else.
After the re-run: `current` is the ledger's version, `doctor` finds no problem, and the move, pin or
deletion is recorded exactly once. Two crafted versions (tests/store/test_adapters.py: published and
recorded as a night does, no training), the real CLI in a subprocess per step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.contract import crashpoints
from jobs.store import adapters
from jobs.store.doctor import diagnose
from jobs.store.integrity import ledger_in_service
from jobs.store.readonly import open_read_only
from jobs.store.registry import CURRENT_SWAPPED, Registry
from tests.conftest import REPO, hang_bound
from tests.store.test_adapters import craft

# (command, point, what the re-run exits with, the version in service at the end); v2 is in service at first.
# A kill after `current` moved leaves the command done but for its announcement: a promote re-run is refused
# as already in service (`nightshift hotswap` re-sends), a rollback re-run has nothing earlier to go to.
CASES = [
    (("promote", "1"), adapters.PROMOTION_RECORDED, 0, 1),
    (("promote", "1"), CURRENT_SWAPPED, 1, 1),
    (("rollback",), adapters.PROMOTION_RECORDED, 0, 1),
    (("rollback",), CURRENT_SWAPPED, 1, 1),
    (("pin", "1"), adapters.PIN_RECORDED, 0, 2),
    (("unpin", "1"), adapters.PIN_RECORDED, 0, 2),
    (("prune",), adapters.PRUNED_RECORDED, 0, 2),
    (("prune",), adapters.PRUNED_RENAMED, 0, 2),
]


def _setup(tmp_path: Path, pinned: bool) -> tuple[Path, Path]:
    state = tmp_path / "state"
    craft(state, 1)
    craft(state, 2)  # in service
    (tmp_path / "inbox").mkdir()
    cfg = tmp_path / "nightshift.toml"
    cfg.write_text(f'state_dir = "{state}"\n[model]\npath = "{tmp_path / "model"}"\nname = "tiny"\n'
                   f'[[sources]]\nname = "inbox"\ninbox = "{tmp_path / "inbox"}"\n'
                   "[registry]\nkeep_promoted = 1\n")  # prune deletes v1
    if pinned:
        assert _cli(cfg, "pin", "1").returncode == 0
    return state, cfg


def _cli(cfg: Path, *argv: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != crashpoints.ENV}
    env["PYTHONPATH"] = str(REPO)
    if crash_at is not None:
        env[crashpoints.ENV] = crash_at
    return subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), "adapters", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=hang_bound(60))


def _ledger(state: Path) -> dict[str, object]:
    led = open_read_only(state / "ledger.sqlite")
    try:
        return {"in_service": ledger_in_service(led),
                "statuses": {int(r["version"]): r["status"] for r in led.versions()},
                "moves": [(int(r["version"]), r["action"]) for r in led.promotions()], "pinned": led.pinned(),
                "events": [(r["kind"], r["version"]) for r in led.db.execute("SELECT kind, version FROM events")]}
    finally:
        led.close()


def _problems(state: Path) -> list[tuple[str, str]]:
    return [(f.subject, f.text) for f in diagnose(state) if f.level == "problem"]


def _current(state: Path) -> int | None:
    reg = Registry(state, create=False)
    cur = reg.current()
    if cur is not None:
        reg.verify(cur)  # IntegrityError: `current` on a version that does not verify
    return reg.current_version()


@pytest.mark.parametrize(("argv", "point", "rerun_code", "final"), CASES,
                         ids=[f"{' '.join(c[0])}@{c[1]}" for c in CASES])
def test_a_command_killed_at_a_write_point_is_finished_by_running_it_again(
    tmp_path: Path, argv: tuple[str, ...], point: str, rerun_code: int, final: int
) -> None:
    state, cfg = _setup(tmp_path, pinned=argv[0] == "unpin")
    before = _ledger(state)
    killed = _cli(cfg, *argv, crash_at=point)
    assert killed.returncode == -signal.SIGKILL, f"{point} not reached: {killed.stdout}{killed.stderr}"

    # what a restart finds: `current` verified; the ledger's version verified too (a night or a re-run moves to it)
    after = _ledger(state)
    in_service = after["in_service"]
    Registry(state, create=False).verify(state / "adapters" / f"tiny-v{in_service:04d}")
    problems = _problems(state)
    if _current(state) == in_service:
        assert problems == [], problems
    else:  # the ledger is ahead: the one problem doctor names is `current`, and its fix is to promote that one
        assert point == adapters.PROMOTION_RECORDED and in_service == final, (after, _current(state))
        assert [c for c, _ in problems] == ["current"] and f"tiny-v{final:04d} is in service" in problems[0][1]

    again = _cli(cfg, *argv)
    assert again.returncode == rerun_code, again.stdout + again.stderr
    if rerun_code:
        assert "already in service" in again.stderr or "no earlier promoted version" in again.stderr, again.stderr
    end = _ledger(state)
    assert _current(state) == end["in_service"] == final and _problems(state) == []
    assert not [p for p in (state / "adapters").iterdir() if p.name.startswith(adapters.PRUNING)]
    if argv[0] in ("promote", "rollback"):  # the move recorded once, its event once
        assert end["moves"] == [*before["moves"], (1, argv[0])], end["moves"]
        assert end["events"].count((argv[0], 1)) == 1, end["events"]
    if argv[0] == "pin":
        assert end["pinned"] == {1}
    if argv[0] == "unpin":
        assert end["pinned"] == set()
    if argv[0] == "prune":
        assert end["statuses"] == {1: "pruned", 2: "promoted"} and end["events"].count(("pruned", 1)) == 1
        assert sorted(p.name for p in (state / "adapters").iterdir()) == ["tiny-v0002"]


def test_every_operator_crash_point_has_a_case() -> None:
    declared = {p for p in crashpoints.POINTS if p.startswith("adapters.")}
    assert {point for _, point, _, _ in CASES if point.startswith("adapters.")} == declared
