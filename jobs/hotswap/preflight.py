"""What a LoRA server can load, checked before every load: a refusal the server would give is
known here first, said in one line, and never retried.

vLLM (vllm/config/lora.py, vllm/lora/peft_helper.py, 0.32.0): `--max-lora-rank` must be one of
1, 8, 16, 32, 64, 128, 256, 320, 512 (default 16); an adapter whose rank (or any rank_pattern
entry) is above it is refused with HTTP 500 "LoRA rank 16 is greater than max_lora_rank 8."; DoRA,
LoRA bias and modules_to_save other than classifier/score are refused too. LoRA on MoE experts needs
its FusedMoE-LoRA kernels. vLLM does not tell its limits over HTTP: the target's `max_lora_rank`
and `expert_lora` say what it was started with.
SGLang says its limits at GET /get_server_info (`max_lora_rank`, `lora_target_modules`); those win
over the target's settings. Expert LoRA is not in SGLang (a feature request): always refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.hotswap.config import LoraServerTarget
from jobs.hotswap.core import TargetError

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
# 500s whose text says the adapter itself is refused: the same answer every time.
DETERMINISTIC_500 = re.compile(r"greater than max_lora_rank|not (yet )?support|Unsupported", re.IGNORECASE)
_EXPERT = re.compile(r"(^|\.)(experts|block_sparse_moe|moe)(\.|$)", re.IGNORECASE)


@dataclass(frozen=True)
class AdapterShape:
    """What a server must hold room for, read from the adapter's adapter_config.json."""

    rank: int
    target_modules: tuple[str, ...]
    expert: bool
    unsupported: tuple[str, ...]  # features vLLM refuses (DoRA, bias, modules_to_save)


@dataclass(frozen=True)
class ServerLimits:
    max_lora_rank: int
    target_modules: frozenset[str] | None  # None: any module
    expert_lora: bool
    said_by: str  # "configuration" or the route that said it


def adapter_shape(path: Path) -> AdapterShape:
    cfg_path = Path(path) / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TargetError(f"{cfg_path}: cannot read the adapter's config: {e}", retryable=False) from e
    if not isinstance(cfg, dict):
        raise TargetError(f"{cfg_path}: not a JSON object", retryable=False)
    ranks = [int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())]
    modules = cfg.get("target_modules") or []
    modules = (modules,) if isinstance(modules, str) else tuple(str(m) for m in modules)
    expert = bool(cfg.get("target_parameters")) or any(_EXPERT.search(m) for m in modules)
    unsupported = []
    if cfg.get("use_dora"):
        unsupported.append("DoRA (use_dora)")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        unsupported.append(f"LoRA bias ({cfg.get('bias')})")
    extra = [m for m in cfg.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if extra:
        unsupported.append(f"modules_to_save {extra}")
    return AdapterShape(max(ranks), modules, expert, tuple(unsupported))


def limits_from(t: LoraServerTarget, server_info: Any) -> ServerLimits:
    """The target's settings, overridden by what an SGLang's /get_server_info said."""
    info = server_info if isinstance(server_info, dict) else {}
    rank = info.get("max_lora_rank")
    modules = info.get("lora_target_modules")
    said = "/get_server_info" if rank is not None or modules is not None else "configuration"
    if isinstance(modules, str):
        modules = [modules]
    chosen = modules if isinstance(modules, list) and modules and modules != ["all"] else t.lora_target_modules
    return ServerLimits(
        max_lora_rank=int(rank) if isinstance(rank, int) and rank > 0 else t.max_lora_rank,
        target_modules=frozenset(chosen) if chosen else None,
        expert_lora=t.expert_lora and t.kind == "vllm",
        said_by=said,
    )


def check(t: LoraServerTarget, name: str, shape: AdapterShape, lim: ServerLimits) -> None:
    """Raise a permanent TargetError naming every way `shape` does not fit the server."""
    problems = []
    if shape.rank > lim.max_lora_rank:
        problems.append(f"rank {shape.rank} > the server's max_lora_rank {lim.max_lora_rank} ({lim.said_by}); "
                        f"start it with --max-lora-rank {_fitting_rank(shape.rank)} and set max_lora_rank")
    if lim.target_modules is not None:
        missing = [m for m in shape.target_modules if m not in lim.target_modules]
        if missing:
            problems.append(f"target modules {missing} not among the server's {sorted(lim.target_modules)}")
    if shape.expert and not lim.expert_lora:
        problems.append("LoRA on MoE experts, which this server does not run"
                        + (" (set expert_lora = true where vLLM has FusedMoE-LoRA)" if t.kind == "vllm" else ""))
    if t.kind == "vllm" and shape.unsupported:
        problems.append(f"{', '.join(shape.unsupported)}: vLLM refuses it")
    if problems:
        raise TargetError(f"{name} does not fit {t.name}: " + "; ".join(problems), retryable=False,
                          detail={"preflight": problems})


def _fitting_rank(rank: int) -> int:
    return next((r for r in VLLM_RANKS if r >= rank), rank)
