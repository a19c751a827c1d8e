"""The night says how many of its modules were compiled from source (no bytecode beside them, none written)."""

import compileall
import importlib
import sys

from structlog.testing import capture_logs

from jobs.runtime import bytecode


def test_modules_without_bytecode_are_counted_by_package_until_compiled(tmp_path, monkeypatch):
    pkg = tmp_path / "nsprobe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1, or a read-only venv
    for name in ("nsprobe_pkg", "nsprobe_pkg.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    mod = importlib.import_module("nsprobe_pkg.mod")
    mine = {n: m for n, m in sys.modules.items() if n.startswith("nsprobe_pkg")}
    assert mod.X == 1 and bytecode.without_bytecode(mine) == {"nsprobe_pkg": 2}
    assert compileall.compile_dir(str(pkg), quiet=1)
    assert bytecode.without_bytecode(mine) == {}


def test_many_compiled_modules_warn_with_the_fix():
    with capture_logs() as logs:
        bytecode.warn_if_compiled(bytecode.Counter({"torch": 5}))  # a few: normal, nothing said
        bytecode.warn_if_compiled(bytecode.Counter({"transformers": 1800, "unsloth_zoo": 600}))
    [warning] = logs
    assert warning["event"] == "bytecode_missing" and warning["modules"] == 2400
    assert warning["packages"] == {"transformers": 1800, "unsloth_zoo": 600} and "compileall" in warning["detail"]
