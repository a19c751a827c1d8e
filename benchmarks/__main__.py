"""`python -m benchmarks MODE ...`, from a checkout (the benchmark is not in the installed wheel)."""

import contextlib
import sys

from benchmarks.cli import main

with contextlib.suppress(KeyboardInterrupt):
    sys.exit(main())
