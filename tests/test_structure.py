"""The shape of the code, checked: small modules, no import cycles (lazy and type-checking imports
included), `daemon -> jobs` only, the benchmark outside the product, and a daemon that never imports torch."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO, hang_bound

PRODUCT = ("daemon", "jobs")  # what the wheel installs
BENCHMARK = "benchmarks"  # run from a checkout, beside the product: never installed, never imported by it
PACKAGES = (*PRODUCT, BENCHMARK)
MAX_LINES = 400


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def every_import(tree: ast.AST) -> list[ast.stmt]:
    """Every import, at module level or inside a function (a lazy import still closes a cycle), and those
    under `if TYPE_CHECKING:` too: a type named across a cycle ties the two modules together all the same."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def imports(path: Path, name: str, known: set[str], *, top_level_only: bool = False) -> set[str]:
    """The project's modules that `name` imports (all that run, or only those at module level)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if top_level_only else every_import(tree)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`: that module
            targets = [s for s in subs if s in known] or [node.module]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_module_of_daemon_or_jobs_is_over_400_lines():
    long = {name: n for name, path in modules(PRODUCT).items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_benchmark_lives_beside_the_product_and_the_wheel_leaves_it_out():
    """The benchmark's stacks and harness live in `benchmarks/`, which the wheel's package list does not match
    (tests/test_wheel.py builds the wheel and reads its file list)."""
    assert not [name for name in modules(PRODUCT) if "bench" in name.split(".")[-1] or ".bench" in name]
    assert (REPO / BENCHMARK / "__main__.py").is_file()
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert set(include) == {f"{p}*" for p in PRODUCT}


def test_jobs_is_in_wings_and_training_shows_its_core_at_the_top():
    """A module of jobs/ lives in a package named for its meaning (no loose modules beside the wings), and
    jobs/training/ keeps its core path at the top, its FP8, mixture-of-experts, several-ranks and stand-in
    models in wings of their own."""
    assert sorted(p.name for p in (REPO / "jobs").glob("*.py")) == ["__init__.py"]
    training = REPO / "jobs" / "training"
    assert len(list(training.glob("*.py"))) <= 16, sorted(p.name for p in training.glob("*.py"))
    assert {"fp8", "moe", "ranks", "models"} <= {p.parent.name for p in training.glob("*/__init__.py")}
    assert not [p.name for p in training.rglob("*.py") if p.name.startswith(("fp8_", "moe_"))]


def test_no_import_cycles_and_the_layers_point_one_way():
    mods = modules()
    graph = {name: imports(path, name, set(mods)) for name, path in mods.items()}
    assert not [(a, b) for a, deps in graph.items() if a.startswith("jobs") for b in deps
                if b.startswith("daemon")], "jobs must never import daemon"
    # the product (daemon and jobs) never imports the benchmark, not even inside a function: the wheel lacks it
    off_path = [(a, b) for a, deps in graph.items() if a.startswith(PRODUCT) for b in deps
                if b.startswith(BENCHMARK)]
    assert not off_path, f"the benchmark is imported by the product: {off_path}"
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_module_passes_on_names_it_does_not_use():
    """A name is imported from where it is defined: a module that imports another's names only to hand them on
    (jobs/evaluate.py once re-exported the gate's, the ledger the schema's) hides where they live. A package's
    `__init__` may gather its API; a module's `__all__` may list what it uses itself."""
    passed_on = []
    for name, path in modules(PRODUCT).items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {a.value.id for a in ast.walk(tree) if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)}
        quoted = [n.annotation if isinstance(n, ast.arg | ast.AnnAssign) else n.returns for n in ast.walk(tree)
                  if isinstance(n, ast.arg | ast.AnnAssign | ast.FunctionDef | ast.AsyncFunctionDef)]
        annotations = " ".join(q.value for q in quoted if isinstance(q, ast.Constant) and isinstance(q.value, str))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGES):
                passed_on += [f"{name}: {node.module}.{a.name}" for a in node.names
                              if (a.asname or a.name) not in used and (a.asname or a.name) not in annotations]
    assert not passed_on, "imported and not used (a re-export?): " + ", ".join(passed_on)


STATE_FILES = {"ledger.sqlite", "night.lock", "daemon.lock", "hotswap.lock"}  # unmistakable names


def test_the_state_directory_is_named_in_one_place():
    """`StatePaths` (jobs/store/paths.py) names every place of the state directory: no other module joins a
    name onto a state directory (`state / "ledger.sqlite"`) or spells one of its files."""
    spelled = []
    for name, path in modules(PRODUCT).items():
        if name == "jobs.store.paths":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                    and isinstance(node.right.value, str) and "state" in ast.unparse(node.left).lower()):
                spelled.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and node.value in STATE_FILES:
                spelled.append(f"{name}:{node.lineno}: {node.value!r}")
    assert not spelled, "state paths spelled outside StatePaths:\n" + "\n".join(spelled)


def test_the_daemon_and_the_contract_import_no_training_stack():
    code = ("import sys, daemon.cli, daemon.service, jobs.contract; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'unsloth') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=hang_bound(120))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


GPU_ONLY = ("triton", "unsloth", "bitsandbytes")


def test_every_module_imports_on_a_machine_without_the_gpu_libraries():
    """Triton, Unsloth and bitsandbytes are imported where they are used (a kernel's `_jit()`, the backend's loader),
    never at module level: a CPU machine (CI) imports every module of daemon/, jobs/ and benchmarks/."""
    import importlib

    failed = []
    for path in sorted(path for pkg in PACKAGES for path in (REPO / pkg).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if name.endswith("__main__"):
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            failed.append(f"{name}: {e}")
    assert not failed, "\n".join(failed)


def top_level_names(path: Path) -> set[str]:
    """What a module defines at its top level, read from its source (it cannot be imported here)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_name_a_test_imports_from_the_project_exists():
    """The GPU tests only run on the device: one importing a function that was renamed away failed there, long
    after the rename. Every `from daemon/jobs... import name` in the tests (inside functions too) must resolve."""
    import importlib

    missing = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in every_import(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGES):
                continue
            try:
                module = importlib.import_module(node.module)
                names = None
            except ModuleNotFoundError as e:  # a GPU-only dependency (triton) absent here: read the file instead
                if e.name not in GPU_ONLY:
                    raise
                module, names = None, top_level_names(REPO / (node.module.replace(".", "/") + ".py"))
            for alias in node.names:
                defined = hasattr(module, alias.name) if names is None else alias.name in names
                submodule = module is not None and hasattr(module, "__path__") and importlib.util.find_spec(
                    f"{node.module}.{alias.name}")
                if not defined and not submodule:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "\n".join(missing)
