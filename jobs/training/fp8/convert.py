"""Convert a LoRA model's frozen projections to FP8 (issue 16): which projections, in which groups, and back.

Every frozen projection qualifies, whether a LoRA layer wraps it or not: a bitsandbytes Linear4bit
(NF4, dequantised once here, then quantised to e4m3 per output channel) or a plain nn.Linear (bf16
straight to e4m3). Under a LoRA layer the base is swapped (`base_layer`); a projection the adapter
does not target (k, o and the MLP under a q,v adapter) is replaced in its parent (`ModuleSlot`) — it
is found by its name (q/k/v/o_proj, gate/up/down_proj: never lm_head, embeddings or a router) and
must be a frozen Linear. The LoRA projections are found by structure (attention: q/k/v and o; MLP:
gate/up/down; anything else alone) and each unit is computed either by our patched Unsloth function
("fused": q/k/v, gate/up as groups whose input gradient is one GEMM; also where LoRA wraps only some of them,
the others then `ModuleSlot`s of the same unit) or by a module call (PEFT's
forward calling its base, or the parent calling a projection without LoRA: "modules", each FP8Base
alone). A unit behind a function we could not patch ("blocked"), a base we cannot read, a shape the
FP8 GEMM refuses (in/out features not divisible by 16), or a projection whose measured error is over
the limit stays as it is: a fused unit converts all of its projections or none. Every projection kept
is counted with its reason.

Memory: e4m3 holds 1 byte per parameter (+4 bytes per output channel) against NF4's ~0.52; the
transposed copy for the backward (`keep_transposed`) adds 1 byte more. With `storage = "nf4"` a base that was
NF4 stays NF4 (+4 bytes per output channel) and is dequantised to the same e4m3 values at each use
(jobs/training/fp8/nf4.py); a bf16 base gets its e4m3 copy either way. The originals are kept until
`commit()` only when asked (`keep_originals`, so that calibrate can revert everything when the check
fails); otherwise each one is freed as soon as its projection is converted.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from jobs.contract import LayerNumerics
from jobs.training.config import FP8Storage, FP8StorageChoice
from jobs.training.fp8.compute import MAX_LAYER_ERROR
from jobs.training.fp8.matmul import FP8Base, FP8Group, shape_supported
from jobs.training.fp8.nf4 import NF4Source, kept_in_nf4
from jobs.training.fp8.unsloth_layers import is_lora_layer, not_plain, route

log = structlog.get_logger("nightshift.train")

@contextlib.contextmanager
def timed(into: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's seconds to `into[phase]`; on CUDA the GPU work queued in it is waited for, so that
    each phase is charged its own kernels (where the minutes before a first FP8 step go)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        into[phase] = round(into.get(phase, 0.0) + time.perf_counter() - t0, 3)


ROLES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "mlp": ("gate_proj", "up_proj", "down_proj")}
ROLE_KIND = {r: kind for kind, roles in ROLES.items() for r in roles}
# (layer name, dense weight as the bf16 path computes with, its FP8 replacement) -> per-layer numerics
Check = Callable[[str, torch.Tensor, FP8Base, bool], LayerNumerics | None]


def is_frozen_projection(attr: str, m: Any) -> bool:
    """A projection no LoRA layer wraps, by its attribute name, that FP8 may replace: a Linear with a
    frozen weight (bf16 or NF4), or its FP8Base once converted."""
    if attr not in ROLE_KIND or is_lora_layer(m):
        return False
    if isinstance(m, FP8Base):
        return True
    w = getattr(m, "weight", None)
    return isinstance(m, torch.nn.Linear) and isinstance(w, torch.Tensor) and not w.requires_grad


def projection_points(model: Any) -> Iterator[tuple[str, Any, Any, str]]:
    """(name, the module whose input is the projection's input, its parent, its attribute) of every
    LoRA layer and every frozen projection without one."""
    for name, parent in model.named_modules():
        for attr, m in parent.named_children():
            if is_lora_layer(m) or is_frozen_projection(attr, m):
                yield (f"{name}.{attr}" if name else attr), m, parent, attr


@dataclass
class ModuleSlot:
    """A frozen projection without LoRA, seen the way a LoRA layer is: its `base_layer` is the module
    itself, and setting it replaces the module in its parent."""

    parent: Any
    attr: str

    @property
    def base_layer(self) -> Any:
        return getattr(self.parent, self.attr)

    @base_layer.setter
    def base_layer(self, module: Any) -> None:
        setattr(self.parent, self.attr, module)


@dataclass
class Unit:
    kind: str  # "qkv" | "o" | "mlp" | "linear" (a LoRA layer alone) | "frozen" (a projection without LoRA)
    parent: Any  # the module owning the projections
    projs: dict[str, tuple[str, Any]]  # role -> (full name, LoRA layer or ModuleSlot)
    route: str  # "fused" | "modules" | "blocked"
    why: str = ""


def find_units(model: Any) -> list[Unit]:
    """Every frozen projection of the model, in units (see the module doc)."""
    units: list[Unit] = []
    claimed: set[int] = set()
    for name, m in model.named_modules():
        for kind, roles in ROLES.items():
            projs = {r: getattr(m, r, None) for r in roles}
            how, why = route(m, kind)
            if all(is_lora_layer(p) for p in projs.values()):
                slots = dict(projs)
            elif how == "fused" and all(is_lora_layer(p) or is_frozen_projection(r, p) for r, p in projs.items()):
                slots = {r: p if is_lora_layer(p) else ModuleSlot(m, r) for r, p in projs.items()}  # LoRA on some
            else:
                continue
            units.append(Unit(kind, m, {r: (f"{name}.{r}", p) for r, p in slots.items()}, how, why))
            claimed |= {id(p) for p in projs.values()}
    for name, m, parent, attr in projection_points(model):
        if is_lora_layer(m):
            if id(m) not in claimed:
                units.append(Unit("linear", None, {"linear": (name, m)}, "modules"))
        elif not isinstance(m, FP8Base) and id(m) not in claimed:
            how, why = route(parent, ROLE_KIND[attr])
            if how != "modules":  # a function we did not write computes it: it may not read the module
                how, why = "blocked", why or f"{attr} is computed by a fused function"
            units.append(Unit("frozen", parent, {"linear": (name, ModuleSlot(parent, attr))}, how, why))
    return units


def dense_weight(base: Any) -> tuple[torch.Tensor | None, bool, str]:
    """(the weight the bf16 path multiplies with [N, K], whether it came from NF4, or why it cannot)."""
    w = getattr(base, "weight", None)
    if isinstance(base, FP8Base):
        return None, False, "already FP8"
    if not isinstance(w, torch.Tensor):
        return None, False, f"{type(base).__name__} has no dense weight"
    if w.requires_grad:
        return None, False, "base weight is trainable"
    qs = getattr(w, "quant_state", None)
    if qs is not None:
        if getattr(qs, "quant_type", "nf4") not in ("nf4", "fp4"):
            return None, False, f"4-bit type {qs.quant_type}"
        import bitsandbytes.functional as bnbf  # only a bitsandbytes base has a quant_state

        return bnbf.dequantize_4bit(w.data, qs), True, ""
    if type(base) is torch.nn.Linear or (isinstance(base, torch.nn.Linear) and w.dtype.is_floating_point
                                         and w.element_size() >= 2):
        return w.detach(), False, ""
    return None, False, f"unsupported base {type(base).__name__} ({w.dtype})"


NF4_WHEN_COPY_OVER = 0.30  # "auto": NF4 storage where the e4m3 copy would take more of the card's budget than this


def choose_storage(choice: FP8StorageChoice, units: list[Unit], *, keep_transposed: bool,
                   cap_gb: float | None) -> tuple[FP8Storage, str]:
    """Where the FP8 bases are held, and why. "auto": the NF4 bases stay NF4 where their e4m3 copy (1 byte a parameter)
    would take more than NF4_WHEN_COPY_OVER of `cap_gb` (the [gpu] max_vram_gb cap, else the card's memory: the
    same on the calibrate and the night of one throughput key, which holds the cap), else the copy. Measured on one
    H200, table-lookup kernel (RESULTS.md: 2026-11-26, 32B NF4 vs copy calibrate): Qwen3-32B under 72 GB, copy 31 GB
    (43 %): NF4's 3,584-token steps 5,031 / 5,055 tok/s against the copy's 2,304-token 4,844 / 4,294 (calibrate); the
    8B under 40 GB, its copy 7 GB (17 %): the copy 22,114 / 20,466 against NF4's 19,540 / 20,159 (bench)."""
    if choice != "auto":
        return choice, "from [train] fp8_storage"
    if keep_transposed:
        return "fp8", "auto: fp8_keep_transposed keeps an e4m3 copy"
    weights = [getattr(p.base_layer, "weight", None) for u in units if u.route != "blocked"
               for _, p in u.projs.values()]
    copy = sum(math.prod(w.quant_state.shape) for w in weights if kept_in_nf4(w))
    if not copy or not cap_gb:
        return "fp8", "auto: no NF4 base" if not copy else "auto: the card's memory is not known"
    share = copy / 1e9 / cap_gb
    over = share > NF4_WHEN_COPY_OVER
    return ("nf4" if over else "fp8"), (f"auto: an e4m3 copy of the NF4 bases would take {copy / 1e9:.3g} GB, "
                                        f"{share:.0%} of {cap_gb:g} GB ({'over' if over else 'not over'} "
                                        f"{NF4_WHEN_COPY_OVER:.0%})")


@dataclass
class Conversion:
    """Swaps bases for FP8Base, unit by unit; `revert()` puts the originals back (if kept), `commit()`
    forgets them."""

    keep_transposed: bool = False
    storage: FP8Storage = "fp8"  # "fp8": an e4m3 copy of every base; "nf4": an NF4 base stays NF4
    keep_originals: bool = False
    check: Check | None = None
    converted: int = 0
    layers: list[LayerNumerics] = field(default_factory=list)
    fallbacks: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)  # dequantise / quantise / check, over all units
    _swapped: list[tuple[Any, Any]] = field(default_factory=list)  # (LoRA layer, original base or None)
    _attached: list[tuple[Any, str]] = field(default_factory=list)  # (parent, attribute)

    def _keep(self, names: list[str], reason: str, done: dict[str, LayerNumerics]) -> None:
        for n in names:
            self.fallbacks[reason] += 1
            prev = done.get(n)
            self.layers.append(prev.model_copy(update={"converted": False, "fallback": reason}) if prev else
                               LayerNumerics(name=n, shape=(0, 0), fp8=None, converted=False, fallback=reason))

    def run(self, units: list[Unit]) -> Conversion:
        for u in units:
            try:
                self._unit(u)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # never fail the load for FP8: the unit stays as it was
                reason = f"conversion error: {type(e).__name__}: {e}"[:200]
                log.warning("fp8_unit_kept", unit=u.kind, layers=[n for n, _ in u.projs.values()], reason=reason)
                self._keep([n for n, _ in u.projs.values()], reason, {})
        return self

    def _unit(self, u: Unit) -> None:
        names = [n for n, _ in u.projs.values()]
        if u.route == "fused":  # the FP8 Functions run plain LoRA only: anything else would run Unsloth's own
            why = next((w for _, p in u.projs.values() if is_lora_layer(p) and (w := not_plain(p))), None)
            if why:
                u.route, u.why = "blocked", why
        if u.route == "blocked":
            self._keep(names, u.why, {})
            return
        new: dict[str, FP8Base] = {}
        done: dict[str, LayerNumerics] = {}
        failed: list[tuple[str, str]] = []
        for role, (name, proj) in u.projs.items():
            base = proj.base_layer
            bias = getattr(base, "bias", None)
            with timed(self.seconds, "dequantise"):
                w, from_nf4, why = dense_weight(base)
            if w is None:
                failed.append((name, why))
                continue
            if not shape_supported(*w.shape):
                failed.append((name, f"shape {tuple(w.shape)} not divisible by 16"))
                continue
            if u.route == "fused" and bias is not None:
                failed.append((name, "base bias in a fused layer"))
                continue
            with timed(self.seconds, "quantise"):
                src = NF4Source.from_params4bit(base.weight) if self.storage == "nf4" and from_nf4 else None
                fp8 = FP8Base.from_nf4(src, w, bias) if src is not None else FP8Base.from_weight(w, bias).to(w.device)
            with timed(self.seconds, "check"):
                num = self.check(name, w, fp8, from_nf4) if self.check else None
            del w
            if num is not None:
                done[name] = num
                if num.fp8 is None or not num.fp8 <= MAX_LAYER_ERROR:
                    failed.append((name, f"FP8 error {num.fp8} over {MAX_LAYER_ERROR}"))
                    continue
            new[role] = fp8
        if failed and (u.route == "fused" or len(u.projs) == 1):
            for name, why in failed:
                self._keep([name], why, done)
            self._keep([n for n in names if n not in {f for f, _ in failed}], "its fused layer stays bf16", done)
            return
        for name, why in failed:
            self._keep([name], why, done)
        for role, fp8 in new.items():
            name, proj = u.projs[role]
            old = proj.base_layer
            proj.base_layer = fp8
            self._swapped.append((proj, old if self.keep_originals else None))
            self.converted += 1
            self.layers.append(done.get(name) or LayerNumerics(name=name, shape=(fp8.out_features, fp8.in_features),
                                                               fp8=None))
            if u.route == "modules":
                fp8.own_group(keep_transposed=self.keep_transposed)
            del old
        if u.route == "fused":
            self._attach(u, new)

    def _attach(self, u: Unit, new: dict[str, FP8Base]) -> None:
        kt = self.keep_transposed
        if u.kind == "qkv":
            value: Any = FP8Group([new["q_proj"], new["k_proj"], new["v_proj"]], keep_transposed=kt)
            attr = "_ns_fp8_qkv"
        elif u.kind == "o":
            value, attr = FP8Group([new["o_proj"]], keep_transposed=kt), "_ns_fp8_o"
        else:
            value = (FP8Group([new["up_proj"], new["gate_proj"]], keep_transposed=kt),
                     FP8Group([new["down_proj"]], keep_transposed=kt))
            attr = "_ns_fp8_mlp"
        setattr(u.parent, attr, value)
        self._attached.append((u.parent, attr))

    def revert(self) -> int:
        """Every converted projection back to its original base (only with keep_originals)."""
        if any(old is None for _, old in self._swapped):
            raise RuntimeError("the originals were not kept: this conversion cannot be reverted")
        for proj, old in self._swapped:
            proj.base_layer = old
        for parent, attr in self._attached:
            parent.__dict__.pop(attr, None)
        n = len(self._swapped)
        self._swapped.clear()
        self._attached.clear()
        self.converted = 0
        _free()
        return n

    def commit(self) -> None:
        self._swapped = [(p, None) for p, _ in self._swapped]
        _free()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def base_bytes(model: Any) -> dict[str, float]:
    """GB held by the frozen projections (under LoRA layers or not): e4m3 weights and scales, FP8 bases kept in NF4,
    kept transposed copies, and whatever the others hold (NF4 packed bytes and their absmax, or bf16)."""
    fp8 = fp8_nf4 = other = kept = 0
    groups: set[int] = set()
    for _name, m, _parent, _attr in projection_points(model):
        b = m.base_layer if is_lora_layer(m) else m
        n = sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()])
        if isinstance(b, FP8Base):
            if b.nf4 is None:
                fp8 += n
            else:
                fp8_nf4 += n
            for g in (b._single,):
                if g is not None and id(g) not in groups:
                    groups.add(id(g))
                    kept += g.kept_bytes
        else:
            qs = getattr(getattr(b, "weight", None), "quant_state", None)
            absmax = getattr(qs, "absmax", None)
            other += n + (absmax.numel() * absmax.element_size() if isinstance(absmax, torch.Tensor) else 0)
    for m in model.modules():
        for attr in ("_ns_fp8_qkv", "_ns_fp8_o", "_ns_fp8_mlp"):
            v = m.__dict__.get(attr)
            for g in (v if isinstance(v, tuple) else (v,)):
                if isinstance(g, FP8Group) and id(g) not in groups:
                    groups.add(id(g))
                    kept += g.kept_bytes
    return {"fp8_gb": round(fp8 / 1e9, 3), "fp8_nf4_gb": round(fp8_nf4 / 1e9, 3),
            "fp8_transposed_gb": round(kept / 1e9, 3),
            "other_gb": round(other / 1e9, 3)}
