"""`nightshift report`: the last nights as one self-contained HTML file (or their data as JSON)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from daemon.report_data import adapter_states, collect_adapters
from daemon.report_html import render
from daemon.settings import Settings

DEFAULT_OUT = "nightshift-report.html"


def add_command(sub: Any) -> None:
    p = sub.add_parser("report", help="an HTML page of the last nights with plots (self-contained), or --json",
                       description="Write one self-contained HTML file (inline CSS and SVG plots, no scripts or "
                                   "fonts fetched) of the last nights: data, throughput, budget, losses and metrics "
                                   "with the gate's decision, energy, GPU memory, the last loss curve; one section "
                                   "per adapter where the config has several.")
    p.add_argument("--nights", type=int, default=14, metavar="N",
                   help="how many of the last runs (of each adapter; default: 14)")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help=f"where the HTML goes (default: ./{DEFAULT_OUT}, in the working directory: a report "
                        "only reads the state directory; - for stdout)")
    p.add_argument("--json", action="store_true", help="print the same data as JSON instead of writing HTML")
    p.set_defaults(func=cmd_report)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_report(args: argparse.Namespace, s: Settings) -> int:
    if args.nights < 1:
        print("--nights: give at least 1", file=sys.stderr)
        return 2
    report = collect_adapters(adapter_states(s), Path(s.state_dir), args.nights,
                              price_per_gpu_hour=s.gpu.price_per_gpu_hour)
    if args.json:
        print(report.model_dump_json(indent=2))
        return 0
    html = render(report)
    if str(args.out) == "-":
        sys.stdout.write(html)
        return 0
    out = args.out or Path(DEFAULT_OUT)
    write_atomically(out, html)
    of = f" of {len(report.adapters)} adapters" if report.adapters else ""
    print(f"{out}: {report.night_count()} night(s){of}")
    return 0
