"""One table helper for every table nightshift prints: rich tables for the terminal (plain text
when not a TTY, so logs and pipes stay readable), Markdown for the benchmark's results."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table


def _text(table: Table) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, highlight=False, soft_wrap=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


def key_values(rows: Sequence[tuple[str, Any]]) -> str:
    """Two columns, name and value: a summary, a plan, a status."""
    t = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, "—" if v is None else str(v))
    return _text(t)


def grid(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, max_width: int = 80) -> str:
    """A table with a header row: runs, versions."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in columns:
        t.add_column(c, overflow="fold", max_width=max_width)
    for r in rows:
        t.add_row(*("—" if v is None else str(v) for v in r))
    return _text(t)


def markdown(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table (benchmark results go into READMEs)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("—" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
