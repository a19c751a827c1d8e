"""The documentation says what the code does: every configuration key is documented, the README's commands are
the ones CI runs, the README stays a manual, every relative link resolves, and every figure cited from the code or
the docs is a row of the one results table (never a log folder)."""

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from daemon.settings import Settings
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
CONFIG_PAGE = (REPO / "docs" / "configuration.md").read_text()
RESULTS = REPO / "benchmarks" / "RESULTS.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), RESULTS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def keys():
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else next(
            (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            yield name, name
        else:
            for sub in model.model_fields:
                yield name, sub


def test_every_settings_key_is_on_the_configuration_page():
    missing = [f"[{section}] {key}" for section, key in keys()
               if not re.search(rf"`[^`]*\b{key}\b[^`]*`", CONFIG_PAGE)]
    assert not missing, f"undocumented keys in docs/configuration.md: {missing}"


def test_the_readme_points_at_the_configuration_page_and_the_schema():
    assert "docs/configuration.md" in README and "nightshift config --schema" in README


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_cmds = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert len(blocks) >= 2 and test_cmds
    ci = (REPO / ".ci" / "run").read_text()
    assert all(cmd in ci for cmd in test_cmds)


def test_the_readme_is_a_manual_of_at_most_300_lines():
    n = len(README.splitlines())
    assert n <= 300, f"README.md has {n} lines: move the detail to a docs/ page"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-") for h in heads}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def _rows() -> set[tuple[str, str]]:
    return set(re.findall(r"^\| (\d{4}-\d\d-\d\d) \| ([^|]+?) \|", RESULTS.read_text(), re.M))


def _cited_files():
    for top in ("daemon", "jobs", "tests", "config", "deploy", "docs", "benchmarks"):
        for f in (REPO / top).rglob("*"):
            if f.suffix in {".py", ".md", ".toml", ".yml", ".sh"} and f.is_file():
                yield f
    yield REPO / "README.md"


def _joined(f: Path) -> str:
    """The file's text with line breaks inside a citation joined (docstrings, comments, wrapped Markdown)."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", f.read_text())


def _names_a_row(date: str, after: str, rows: set[tuple[str, str]]) -> bool:
    """A citation names a row when the text after its date starts with the row's name and the name ends there."""
    return any(d == date and after.startswith(name) and not after[len(name):len(name) + 1].isalnum()
               for d, name in rows)


def test_every_cited_figure_is_a_row_of_the_results_table():
    rows, missing, cited = _rows(), [], 0
    assert len(rows) >= 40
    for f in _cited_files():
        text = _joined(f)
        found = re.findall(r"RESULTS\.md: (\d{4}-\d\d-\d\d), (?=(.{1,80}))", text)
        found += re.findall(r"\[(\d{4}-\d\d-\d\d), ([^\]]+\])\([^)]*RESULTS\.md\)", text)
        for date, after in found:
            cited += 1
            if not _names_a_row(date, after, rows):
                missing.append(f"{f.relative_to(REPO)}: {date}, {after[:40]}")
    assert cited >= 30 and not missing, missing


def test_nothing_cites_a_log_folder():
    this = Path(__file__).resolve()
    cites = [f"{f.relative_to(REPO)}: {m}" for f in _cited_files() if f.resolve() != this
             for m in re.findall(r"\bresults/[\w./*-]*", f.read_text())]
    assert not cites, cites


def test_the_raw_evidence_stays_small():
    size = sum(f.stat().st_size for f in (REPO / "benchmarks" / "evidence").rglob("*") if f.is_file())
    assert size <= 2 * 1024 * 1024, f"benchmarks/evidence/ holds {size / 1e6:.1f} MB: keep only what a row cites"
