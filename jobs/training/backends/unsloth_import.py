"""Import Unsloth for nightshift's own training loop, without its rewrite of every TRL trainer.

Unsloth 2026.10 ends `unsloth/models/llama.py` with `PatchFastRL(FastLanguageModel=FastLlamaModel)`:
PatchRL on the model class, then `patch_trl_rl_trainers()` and its siblings, which import every TRL
trainer (and TRL's experimental ones) and generate a patched source for each: `import unsloth` took
28.6 / 28.4 s on an H200 host, 21.0 / 21.7 s without them (fresh processes, alternated;
RESULTS.md: 2026-11-26, imports without TRL rewrite), for trainers a night never uses (it trains through
jobs/training/loop.py).
Unsloth skips exactly that rewrite itself under UNSLOTH_ALLOW_CPU=1 (its CPU CI), a switch with other
effects; `import_unsloth(trl_trainers=False)` keeps only that switch's behaviour for PatchFastRL.

The bench's workers import it whole (`trl_trainers=True`): the Fixstars recipe runs TRL's SFTTrainer.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

RL_MODULE = "unsloth.models.rl"


class _PatchFastRLWithoutTrainers(importlib.abc.MetaPathFinder):
    """Finds `unsloth.models.rl` through the other finders and, once it has executed, replaces its
    PatchFastRL before llama.py (imported next) calls it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != RL_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _trimmed(spec.loader.exec_module)  # type: ignore[method-assign]
                return spec  # (this spec's own loader: nothing else is changed)
        return None


def _trimmed(run: Any) -> Any:
    def exec_module(module: types.ModuleType) -> None:
        run(module)
        _trim(module)

    return exec_module


def _trim(rl: types.ModuleType) -> None:
    """PatchFastRL as Unsloth runs it under UNSLOTH_ALLOW_CPU=1; nothing changed where this Unsloth has
    no such pair."""
    patch_rl = getattr(rl, "PatchRL", None)
    if patch_rl is None or not callable(getattr(rl, "PatchFastRL", None)):
        return

    def PatchFastRL(algorithm: Any = None, FastLanguageModel: Any = None) -> None:  # Unsloth's names
        if FastLanguageModel is not None:
            patch_rl(FastLanguageModel)

    rl.PatchFastRL = PatchFastRL  # type: ignore[attr-defined]


def import_unsloth(*, trl_trainers: bool = False) -> bool:
    """`import unsloth` (patches transformers and peft: before anything imports them). Returns whether
    this process's Unsloth skipped the TRL trainer rewrite (an earlier import decided it)."""
    if "unsloth" not in sys.modules and not trl_trainers:
        finder = _PatchFastRLWithoutTrainers()
        sys.meta_path.insert(0, finder)
        try:
            importlib.import_module("unsloth")
        finally:
            sys.meta_path.remove(finder)
    importlib.import_module("unsloth")

    rl = sys.modules.get(RL_MODULE)
    return getattr(getattr(rl, "PatchFastRL", None), "__module__", None) == __name__
