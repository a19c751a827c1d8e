"""Which of this process's modules were compiled from source because no bytecode lay beside them.

A night's process imports ~6,000 modules (torch, transformers, Unsloth) before its first step. Where the software
was installed without bytecode (uv does not write it unless asked; pip does) and no process may write it (a venv
owned by root, PYTHONDONTWRITEBYTECODE), every night compiles them all again: on one H100 host the imports took
29.3-31.1 s, 15.3-15.8 s once the venv was compiled (RESULTS.md: 2026-11-26, wake bytecode). The night says so in
its log, with the fix, instead of waking slowly without a word. Counting them costs ~16 ms for ~3,700 modules
(torch, transformers, peft imported) on the 2-core box.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Mapping
from types import ModuleType

import structlog

WARN_AT = 200  # modules without bytecode: a few are normal (a script, a package edited in place)
log = structlog.get_logger("nightshift.night")


def without_bytecode(modules: Mapping[str, ModuleType] | None = None) -> Counter[str]:
    """Top-level package -> its imported modules whose source has no bytecode file now (where this Python looks
    for it: __pycache__, or sys.pycache_prefix)."""
    out: Counter[str] = Counter()
    for name, module in list((sys.modules if modules is None else modules).items()):
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if isinstance(origin, str) and origin.endswith(".py") and cached and not os.path.exists(cached):
            out[name.partition(".")[0]] += 1
    return out


def warn_if_compiled(missing: Counter[str]) -> None:
    """A warning with the fix where many modules had to be compiled (every night will again)."""
    n = sum(missing.values())
    if n >= WARN_AT:
        log.warning("bytecode_missing", modules=n, packages=dict(missing.most_common(8)),
                    detail="these modules were compiled from source, and every night's process compiles them again "
                    "(no bytecode where they are installed, and none written); compile them once as the owner "
                    f"of the installation: {sys.executable} -m compileall -q {sysconfig.get_paths()['purelib']} "
                    "(pip writes bytecode at install; uv only with --compile-bytecode)")
