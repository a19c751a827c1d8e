"""`nightshift capture`: the OpenAI-compatible pass-through that records served replies and takes feedback
(jobs/capture/). A process of its own, beside the service: it never imports the training stack."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from daemon.settings import Settings
from jobs.store.paths import StatePaths


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "capture", help="pass-through in front of the inference server: records replies, takes feedback",
        description="Forward every request to --upstream unchanged and relay its answer unchanged; keep chat "
                    "completions (redacted) so that POST /nightshift/feedback can rate, edit or choose between "
                    "replies by their id; each acknowledged feedback is a record in the inbox (fsynced first). "
                    "Metrics at GET /nightshift/metrics. Listens on loopback unless --host says otherwise.")
    p.add_argument("--upstream", required=True, metavar="URL", help="the inference server, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    p.add_argument("--port", type=int, default=8100, help="listen port (default 8100)")
    p.add_argument("--inbox", type=Path, help="where feedback records land (default: the first [[sources]] inbox)")
    p.add_argument("--redact", action="append", default=[], metavar="REGEX",
                   help="replace every match by [redacted] before anything is written (repeatable)")
    p.add_argument("--max-captures", type=int, default=10_000, help="replies held for feedback (memory bound)")
    p.add_argument("--max-inbox-mb", type=float, default=1024, help="feedback waiting in the inbox, then refused")
    p.add_argument("--captures-per-second", type=float, default=50.0, help="over it: forwarded, not captured")
    p.add_argument("--feedback-per-second", type=float, default=20.0, help="over it: HTTP 429")
    p.set_defaults(func=cmd_capture)


def cmd_capture(args: argparse.Namespace, s: Settings) -> int:
    from jobs.capture.config import CaptureConfig
    from jobs.capture.server import serve

    inbox = args.inbox or (s.sources[0].inbox if s.sources else None)
    if inbox is None:
        print("nightshift capture: no --inbox and no [[sources]] inbox in the config to put feedback in",
              file=sys.stderr)
        return 2
    try:
        cfg = CaptureConfig(upstream=args.upstream, inbox=inbox, state=StatePaths(s.state_dir).capture,
                            host=args.host, port=args.port, redact=args.redact, max_captures=args.max_captures,
                            max_inbox_bytes=int(args.max_inbox_mb * 2**20),
                            captures_per_second=args.captures_per_second,
                            feedback_per_second=args.feedback_per_second)
    except ValidationError as e:
        for err in e.errors():
            print(f"nightshift capture: {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
    serve(cfg)
    return 0
