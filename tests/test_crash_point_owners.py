"""Every crash point the product declares is killed by some test (issue 40: "none is skipped"): the night's own
writes by tests/store/test_crash_points.py, the training loop's by tests/training/test_kill_each_point.py (one
process and each of two ranks), the operator commands' by tests/store/test_operator_crash_points.py and the capture
process's by tests/capture/test_capture_kill.py, the point between a night's adapters by
tests/night/test_adapters.py. A point of a new family fails here until a test owns it."""

import importlib
import pkgutil

import jobs
from tests.store.crash_harness import NIGHT_POINTS

OWNERS = {
    NIGHT_POINTS: "tests/store/test_crash_points.py",
    ("train.",): "tests/training/test_kill_each_point.py",
    ("adapters.",): "tests/store/test_operator_crash_points.py",
    ("capture.",): "tests/capture/test_capture_kill.py",
    ("night.",): "tests/night/test_adapters.py",  # between the adapters of a night of several
}


def test_every_declared_crash_point_has_a_test_that_kills_there():
    for m in pkgutil.walk_packages(jobs.__path__, "jobs."):  # every module imports on a CPU (test_structure)
        importlib.import_module(m.name)
    from jobs.contract.crashpoints import POINTS

    unowned = [p for p in POINTS if not any(p.startswith(prefixes) for prefixes in OWNERS)]
    assert not unowned, f"crash points no test kills: {unowned}"
    assert len(POINTS) >= 30  # 20 of a night, 7 of the loop, 4 of the operator commands, 2 of the capture
