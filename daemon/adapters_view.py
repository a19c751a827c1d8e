"""What `adapters show` and `adapters diff` print at a terminal: a summary a person reads in one screen.

A manifest holds ~1,000 lines (the config, every file's hash, the loss curve step by step); the full JSON
stays behind `--json`. A diff of two versions collapses a list's entries (a loss curve: one line per step)
into one line per list.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

from daemon.tables import key_values

# (label, key path in the manifest): what an operator asks of a version, in that order
SHOWN = (
    ("night", "night"), ("run", "run_id"), ("parent", "parent_version"), ("base model", "base_model.path"),
    ("samples", "data.samples"), ("tokens", "data.tokens"), ("held-out samples", "data.heldout_samples"),
    ("replayed samples", "data.replay_samples"), ("held-out loss before", "losses.heldout_before"),
    ("held-out loss after", "losses.heldout_after"), ("regression loss before", "losses.regression_before"),
    ("regression loss after", "losses.regression_after"), ("lora rank", "config.train.lora_rank"),
    ("learning rate", "config.train.learning_rate"), ("code", "code_version"),
)
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _get(d: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _fig(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) \
        else str(v)


def show_lines(name: str, state: str, manifest: dict[str, Any], extra: Sequence[tuple[str, str]] = ()) -> str:
    """The head line, the figures an operator asks for (`extra`: derived ones, e.g. the cost per token), the gate's
    checks that failed, and where the rest is."""
    pairs = [(label, _fig(v)) for label, path in SHOWN if (v := _get(manifest, path)) is not None]
    pairs.extend(extra)
    gate = manifest.get("gate") or {}
    if gate:
        failed = [c.get("name", "?") for c in gate.get("checks") or [] if isinstance(c, dict) and not c.get("passed")]
        pairs.append(("gate", "passed" if gate.get("passed") else "failed: " + (", ".join(failed) or "see --json")))
    return (f"# {name}: {state}\n" + key_values(pairs) +
            f"\n\n(the whole manifest: nightshift adapters show {name} --json)")


# figures of every set under every model: in `diff` only the version's own answers (each set's `_after` exact match
# and reply tokens; its losses are `losses.*`) get a line of their own: with every set's before/reference/base loss
# and exact match, two nights' diff printed 65 lines (issue 42); the rest count in one line each, all in --json
_HEADLINE = re.compile(r"^metrics\.[a-z]+_after\.(exact_match|token_accuracy)$")
_SUMMED = ("metrics.", "regression_slices.", "phase_seconds.", "plan.")


def _group(key: str) -> str:
    """The line a differing key is shown on: a list's entries, and the detail of the figures, share one."""
    if key.startswith(_SUMMED) and not _HEADLINE.match(key):
        head = key.split(".", 1)[0]
        return f"{head} (other figures)" if head == "metrics" else head
    m = _INDEX.search(key)
    return key[:m.start()] if m else key


def diff_lines(a: str, b: str, rows: list[tuple[str, Any, Any]]) -> str:
    """One line per differing key; a list's entries (a loss curve), the per-night slices and the figures other than
    exact match and loss collapse into one line each."""
    groups: dict[str, list[tuple[str, Any, Any]]] = {}
    for k, va, vb in rows:
        groups.setdefault(_group(k), []).append((k, va, vb))
    out = [f"# {a} -> {b}: {len(groups)} difference(s) (file hashes left out; every key: --json)"]
    width = max((len(k) for k in groups), default=0)
    for key, items in groups.items():
        if len(items) > 1 or items[0][0] != key:
            out.append(f"  {key.ljust(width)}  {len(items)} entries differ")
            continue
        _, va, vb = items[0]
        delta = ""
        if key.endswith("_at") and isinstance(va, int | float) and isinstance(vb, int | float):  # unix seconds
            out.append(f"  {key.ljust(width)}  {_when(va)} -> {_when(vb)}  ({vb - va:+,.0f} s)")
            continue
        if isinstance(va, int | float) and isinstance(vb, int | float) and not isinstance(va, bool) and va:
            share = "" if key.endswith("version") else f", {(vb - va) / abs(va) * 100:+.1f}%"  # a number, not a size
            change = f"{vb - va:+,}" if isinstance(va, int) and isinstance(vb, int) else f"{vb - va:+.4g}"
            delta = f"  ({change}{share})"
        out.append(f"  {key.ljust(width)}  {_short(va)} -> {_short(vb)}{delta}")
    return "\n".join(out)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _short(v: Any) -> str:
    if isinstance(v, float):  # a loss to 4 decimals (as `show`), not 3.4344150571894825
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, list) and len(v) > 4:
        return f"[{len(v)} values]"
    text = json.dumps(v, default=str) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "..."
