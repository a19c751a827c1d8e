"""`python -m jobs.bench MODE ...` (what `nightshift bench` runs)."""

import contextlib
import sys

from jobs.bench.cli import main

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
