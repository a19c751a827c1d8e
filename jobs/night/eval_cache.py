"""Evaluation results kept per (adapter version, data): the adapter in service is not re-evaluated on
data it was already evaluated on.

Why: the "before" side of the gate measures the adapter in service on the regression set every
night, and that adapter was measured on the very same tokens the night it was the candidate (its
"after"). Versions are never renamed or rewritten, so (base model, version name, backend, device,
evaluation settings, the exact token ids and labels) identify a result. Files under
`state/cache/eval/`; a missing or unreadable one only costs the evaluation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.contract import EvalMetrics
from jobs.data.batching import TokenizedSample


def eval_key(*, base: str, adapter: str, backend: str, device: str, settings: dict[str, Any],
             samples: Sequence[TokenizedSample]) -> str:
    h = hashlib.sha256(json.dumps([base, adapter, backend, device, settings], sort_keys=True).encode())
    for s in samples:
        h.update(array("i", s.input_ids).tobytes() + b"|" + array("i", s.labels).tobytes() + b"#")
    return h.hexdigest()[:32]


class EvalCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def get(self, key: str) -> tuple[bool, EvalMetrics | None]:
        """(found, metrics): a set with nothing to measure is cached as None, so found says which."""
        try:
            doc = json.loads((self.root / f"{key}.json").read_text())
            return True, doc["metrics"]
        except (OSError, ValueError, KeyError, TypeError):
            return False, None

    def put(self, key: str, metrics: EvalMetrics | None) -> None:
        with contextlib.suppress(OSError):  # a cache: never fail the night for it
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"metrics": metrics}))
            os.replace(tmp, self.root / f"{key}.json")
