"""What a state directory already holds, against a config edited between nights (read-only, no torch).

A night continues the lineage of the adapter in service and never silently starts again from the base model
(docs/reliability.md). Three edits of the config broke that without a word from `check-config`: adding
`[[adapters]]` to a config whose state directory holds one adapter's versions (each adapter then starts from the
base under `by-adapter/<name>/`, the old version left in service), taking `[[adapters]]` out again (a new lineage
at the top): problems, so `check-config`, `plan`, `once` and the service refuse before a night. Pointing
`[model] path` at other weights, or another LoRA rank or alpha, is said (notes) and not refused: a night goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobs.store.paths import StatePaths
from jobs.store.registry import Registry
from jobs.store.schema import published_dirs


def lineage_problems(s: Any) -> list[str]:
    """Problems of the config `s` (daemon.settings.Settings) with the state directory as it is on disk."""
    top = StatePaths(s.state_dir)
    names = [a.name for a in s.adapters or []]
    out: list[str] = []
    if names and published_dirs(top.root):
        in_service = _in_service(top.root)
        out.append(
            f"[[adapters]]: state_dir {top.root} holds the versions of a config without [[adapters]] "
            f"({len(published_dirs(top.root))} in {top.adapters}"
            + (f", {in_service.name} in service" if in_service else "") + "); with [[adapters]] each adapter keeps "
            "its own under by-adapter/<name>/ and would start again from the base model. Give the [[adapters]] "
            "config a state_dir of its own, or take [[adapters]] out to continue that adapter")
    if not names:
        held = sorted(p.name for p in _subdirs(top.adapter_dirs) if published_dirs(p))
        if held:
            out.append(
                f"state_dir {top.root} holds the versions of adapters {', '.join(held)} (a config with "
                "[[adapters]]): without [[adapters]] a night would start another adapter from the base model. Put "
                "the [[adapters]] tables back, or give this config a state_dir of its own")
    return out


def lineage_notes(s: Any) -> list[str]:
    """Edits a night goes on under, said by `check-config`, `doctor` and before a night rather than refused: a
    base whose fingerprint differs from the one the adapter in service was trained on (re-saved or other weights:
    only the operator knows), a LoRA rank or alpha other than the adapter in service's (the night keeps its
    shape)."""
    model = Path(s.model.path)
    places = [(a.night.state_dir, a.night.train) for a in s.night_config().adapters] or [(Path(s.state_dir), s.train)]
    out: list[str] = []
    for root, train in places:
        if (model / "config.json").is_file():
            out += _base_problems(Path(root), model)
        out += _shape_problems(Path(root), train)
    return out


def _shape_problems(root: Path, train: Any) -> list[str]:
    """A night continues the adapter in service in its own LoRA shape (jobs/training/load.py): a rank or alpha
    edited in the config was silently not used, while the manifest recorded the edited value."""
    current = _in_service(root)
    try:
        saved = json.loads((current / "adapter_config.json").read_text()) if current else {}
        r, alpha = int(saved["r"]), saved.get("lora_alpha")
    except (OSError, ValueError, KeyError, TypeError):  # a whole model (method = "full"), or damage: doctor's
        return []
    if r == train.lora_rank and (alpha is None or alpha == train.lora_alpha):
        return []
    return [f"[train] lora_rank {train.lora_rank}, lora_alpha {train.lora_alpha:g}: the adapter in service "
            f"{current.name} has rank {r}" + (f", alpha {alpha:g}" if alpha is not None else "") + ", and a night "
            "continues it in that shape (the configured one is not used). Set them back, or start the new "
            "shape in a state_dir of its own"]


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _in_service(root: Path) -> Path | None:
    try:
        return Registry(root, create=False).current()
    except OSError:
        return None


def _base_problems(root: Path, model: Path) -> list[str]:
    """The adapter in service was trained on another base than `[model] path` holds now (its manifest's
    fingerprint of the base: config and each weight file's name, size, head and tail)."""
    from jobs.night.model import model_fingerprint  # no torch; only where a version is in service

    current = _in_service(root)
    try:
        base: dict[str, Any] = json.loads((current / "manifest.json").read_text())["base_model"] if current else {}
        now = model_fingerprint(model)
    except (OSError, ValueError, KeyError, TypeError):  # a damaged version is doctor's to report
        return []
    was = base.get("fingerprint")
    if not was or was == now:
        return []
    return [f"[model] path: {model} is not the base model the adapter in service {current.name} was trained on "
            f"({base.get('path')}, fingerprint {was}; this one is {now}): a night continues it on these "
            "weights (re-saved weights read as other weights too). Point [model] path back at that model, or give "
            "the new base a state_dir of its own"]
