"""The FP8 base inside Unsloth 2026.10.9's fused LoRA layers (issue 16): what we patch and why.

How Unsloth computes a LoRA projection: `FastLlamaModel.patch_peft_model` (also Qwen3, Mistral, ...)
binds, per decoder layer and per instance, `self_attn.apply_qkv = fast_lora.apply_lora_qkv`,
`self_attn.apply_o = fast_lora.apply_lora_o` and `mlp.forward = MethodType(fast_lora.apply_lora_mlp_swiglu,
mlp)`. Those run the autograd Functions LoRA_QKV / LoRA_W / LoRA_MLP, which read the base weight from
`base_layer.weight` without calling the base module: forward `matmul_lora` (NF4 `fast_dequantize` to bf16,
then a bf16 matmul), backward `fast_dequantize(W.t())` and a bf16 matmul. Its own FP8 support (a weight of
dtype float8_e4m3fn with a `weight_scale`, e.g. FbgemmFp8Linear) runs the forward on `torch._scaled_mm`
but dequantises the weight for the input gradient, which is half of the frozen base's FLOPs.

So a replacement base module alone is not enough on Unsloth's fast path: we replace those three instance
attributes with `fp8_apply_qkv` / `fp8_apply_o` / `fp8_apply_mlp`. They run our FP8 Functions
(jobs/training/fp8/lora.py: forward AND input gradient on FP8) when the layer's projections were
converted (the parent holds its FP8Groups) and its LoRA is plain — Unsloth's own checks: one adapter, no dropout, no
lora bias, no DoRA or QAT —; otherwise (the adapter switched off to score the base, say) they call the projections as
modules (counted in STATS.native_calls with the reason): PEFT's forward over the FP8Base modules. Never the function
that was there once the layer is converted: it reads `base_layer.weight` as a dense weight, which an FP8Base does not
hold as Unsloth expects (kept in NF4 it holds none: the first Qwen3-32B night on an H200 failed there, scoring the
base with the adapter off). An unconverted layer keeps Unsloth's. Instance attributes, not module globals: the patch
stays with the model it was applied to. Versioned like `enable_varlen_attention`: only Unsloth 2026.10.9 and only
when every name we rely on exists ("patched"); else "unavailable", and the projections those functions serve are not
converted (they stay NF4/bf16, counted). Where a model runs PEFT's own forwards (no fused
layer), nothing needs patching ("native"): the FP8Base module's forward is the FP8 Function.

Layers Unsloth left unfused because LoRA does not wrap all of their projections (an adapter on q and v only, the
Exxact study's: Unsloth fused nothing) run the same Functions: `install` binds `fp8_apply_qkv` where the attention's
class forward reads `apply_qkv` and `fp8_apply_mlp` over transformers' SwiGLU forward, when the LoRA there is plain
and no base has a bias.
Before, each FP8 projection of such a layer quantised the same input again, every extra input gradient was an add
and the SwiGLU ran as autograd's elementwise ops.

During activation capture (numerics), the patched functions call the projections as modules too, so forward
pre-hooks see every projection's input.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from jobs.training.fp8.matmul import STATS

log = structlog.get_logger("nightshift.train")

UNSLOTH_VERSION = "2026.10.9"
_NEEDED = ("apply_lora_qkv", "apply_lora_o", "apply_lora_mlp_swiglu", "_lora_dropout_and_bias",
           "_has_multiple_active_adapters", "_has_active_dora_adapter", "_has_activation_fake_quantizer",
           "_active_lora_adapter")
_STATE = threading.local()


@dataclass
class PatchReport:
    status: str  # "patched" | "native" | "unavailable"
    detail: str
    qkv: int = 0
    o: int = 0
    mlp: int = 0
    left: dict[str, str] = field(default_factory=dict)  # fused function left as shipped -> why

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "qkv": self.qkv, "o": self.o, "mlp": self.mlp,
                "left": dict(self.left)}


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Patched layers call their projections as modules (so pre-hooks see the inputs)."""
    prev = getattr(_STATE, "capture", False)
    _STATE.capture = True
    try:
        yield
    finally:
        _STATE.capture = prev


def _capture() -> bool:
    return getattr(_STATE, "capture", False)


def _fast_lora() -> Any:
    from unsloth.kernels import fast_lora

    return fast_lora


def _why_not_plain(projs: tuple[Any, ...], x: Any) -> str | None:
    """Why Unsloth's checks say the LoRA of these projections is not plain, else None; projections no LoRA wraps (k
    and the MLP under a q,v adapter) have nothing to check."""
    projs = tuple(p for p in projs if is_lora_layer(p))
    if not projs:
        return None
    fl = _fast_lora()
    if any(fl._has_multiple_active_adapters(p) for p in projs):
        return "several active adapters"
    if any(fl._has_active_dora_adapter(p) for p in projs):
        return "DoRA"
    if any(fl._has_activation_fake_quantizer(p) for p in projs):
        return "activation fake-quantizer (QAT)"
    extras = fl._lora_dropout_and_bias(projs, x)
    if extras is None:
        return "Unsloth runs PEFT's forward here (LoRA variant, disabled adapter or autocast mismatch)"
    dropout_p, biases = extras
    if dropout_p is not None:
        return "LoRA dropout"
    if any(b is not None for b in biases):
        return "LoRA bias"
    if any(fl._active_lora_adapter(p) is None for p in projs):
        return "adapter disabled or merged"
    return None


def is_lora_layer(m: Any) -> bool:
    """A PEFT LoRA layer (its base in `base_layer`), not a projection the adapter leaves alone."""
    return hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)


def _lora(proj: Any) -> tuple[Any, Any, float]:
    """(A, B, scale) of the active adapter; (None, None, 0.0) for a projection no LoRA wraps."""
    if not is_lora_layer(proj):
        return None, None, 0.0
    adapter = _fast_lora()._active_lora_adapter(proj)
    return proj.lora_A[adapter].weight, proj.lora_B[adapter].weight, proj.scaling[adapter]


def _by_modules(parent: Any, kind: str) -> bool:
    """Whether this layer runs its projections as modules: while capturing, or for good after its Function raised."""
    return _capture() or parent.__dict__.get(f"_ns_modules_{kind}", False)


def _failed(parent: Any, kind: str, e: Exception) -> None:
    """A fused FP8 Function raised (the load-time self-test should make this impossible): this layer runs its
    projections as modules (PEFT's forward, each FP8Base alone) for good, and the run goes on."""
    if isinstance(e, torch.OutOfMemoryError):
        raise e
    parent.__dict__[f"_ns_modules_{kind}"] = True
    STATS.bump(STATS.native_calls, f"{kind}: FP8 forward raised {type(e).__name__}: {str(e)[:120]}")
    log.warning("fp8_layer_disabled", kind=kind, error=f"{type(e).__name__}: {e}"[:500])


def fp8_apply_qkv(self: Any, x: Any, *args: Any) -> Any:
    group = self.__dict__.get("_ns_fp8_qkv")
    if group is None and not _capture():
        return self.__dict__["_ns_orig_apply_qkv"](self, x, *args)
    projs = (self.q_proj, self.k_proj, self.v_proj)
    why = "" if _by_modules(self, "qkv") else _why_not_plain(projs, x)  # "": as modules, not counted
    if why is None:
        from jobs.training.fp8.lora import FP8LoraQKV

        try:
            return FP8LoraQKV.apply(x, group, *[t for p in projs for t in _lora(p)])
        except Exception as e:
            _failed(self, "qkv", e)
    elif why:
        STATS.bump(STATS.native_calls, f"qkv: {why}")
    return _qkv_as_modules(self, x)


def fp8_apply_o(self: Any, x: Any) -> Any:
    group = self.__dict__.get("_ns_fp8_o")
    if group is None and not _capture():
        return self.__dict__["_ns_orig_apply_o"](self, x)
    why = "" if _by_modules(self, "o") else _why_not_plain((self.o_proj,), x)
    if why is None:
        from jobs.training.fp8.lora import FP8LoraW

        try:
            return FP8LoraW.apply(x, group, *_lora(self.o_proj))
        except Exception as e:
            _failed(self, "o", e)
    elif why:
        STATS.bump(STATS.native_calls, f"o: {why}")
    return self.o_proj(x)


def fp8_apply_mlp(self: Any, x: Any) -> Any:
    groups = self.__dict__.get("_ns_fp8_mlp")
    if groups is None and not _capture():
        return self.__dict__["_ns_orig_mlp"](x)
    why = "" if _by_modules(self, "mlp") else _why_not_plain((self.gate_proj, self.up_proj, self.down_proj), x)
    if why is None:
        from jobs.training.fp8.lora import FP8LoraMLP

        gate_up, down = groups
        try:
            return FP8LoraMLP.apply(x, gate_up, down, *_lora(self.gate_proj), *_lora(self.up_proj),
                                    *_lora(self.down_proj), *swiglu_kernels(x))
        except Exception as e:
            _failed(self, "mlp", e)
    elif why:
        STATS.bump(STATS.native_calls, f"mlp: {why}")
    return type(self).forward(self, x)  # transformers' MLP: down(act(gate(x)) * up(x)), via the modules


def swiglu_kernels(x: Any) -> tuple[Any, Any]:
    """Unsloth's Triton SwiGLU forward/backward on CUDA (what LoRA_MLP uses); the torch reference
    with the same in-place contract elsewhere."""
    if x.is_cuda:
        from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

        return swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel
    from jobs.training.fp8.lora import swiglu_backward_ref, swiglu_forward_ref

    return swiglu_forward_ref, swiglu_backward_ref


def _mlp_override(module: Any) -> tuple[str, Any] | None:
    """(attribute, bound method) of an MLP whose forward Unsloth replaced per instance, else None."""
    for attr in ("_unsloth_forward", "forward"):
        f = module.__dict__.get(attr)
        if f is not None:
            return attr, f
    return None


def not_plain(proj: Any) -> str | None:
    """Why a LoRA layer is not plain LoRA (one adapter, no dropout, no lora bias, no DoRA), else None."""
    if len(proj.lora_A) != 1:
        return "several adapters"
    if any(not isinstance(d, torch.nn.Identity) for d in proj.lora_dropout.values()):
        return "LoRA dropout (the FP8 layers run plain LoRA)"
    if any(getattr(b, "bias", None) is not None for b in proj.lora_B.values()):
        return "LoRA bias (the FP8 layers run plain LoRA)"
    if len(getattr(proj, "lora_magnitude_vector", None) or {}):
        return "DoRA"
    return None


def _bindable(m: Any, roles: tuple[str, ...]) -> bool:
    """An unfused layer our Functions can run whole: plain LoRA where there is any, no base bias (Qwen2's q, k, v
    have one: each projection then converts alone, behind the module forwards)."""
    projs = [getattr(m, r) for r in roles]
    return not any(is_lora_layer(p) and not_plain(p) for p in projs) and all(
        getattr(getattr(p, "base_layer", p), "bias", None) is None for p in projs)


def _qkv_as_modules(self: Any, x: Any) -> tuple[Any, Any, Any]:
    """Unsloth's original_apply_qkv: what its attention forward calls when the instance has no apply_qkv."""
    return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _is_projection(m: Any) -> bool:
    return isinstance(m, torch.nn.Linear) or is_lora_layer(m)


def _unfused_qkv(m: Any) -> bool:
    """An attention layer Unsloth left unfused (LoRA on some of q, k, v, or none, like an adapter on q and v):
    its class forward reads `apply_qkv` (Unsloth's fast forward) and the instance's is absent or Unsloth's
    original_apply_qkv, which calls the three projections one by one."""
    forward = getattr(type(m), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if code is None or "apply_qkv" not in code.co_consts + code.co_names:  # Unsloth's wraps it (__wrapped__)
        return False
    if not all(_is_projection(getattr(m, r, None)) for r in ("q_proj", "k_proj", "v_proj")):
        return False
    f = m.__dict__.get("apply_qkv")
    return f is None or getattr(f, "__name__", "") == "original_apply_qkv"


def _unfused_swiglu(m: Any) -> bool:
    """A SwiGLU MLP that runs transformers' forward, down(act(gate(x)) * up(x)) with act SiLU (Llama, Qwen3,
    Mistral), which Unsloth left unfused because LoRA does not wrap all three projections."""
    code = getattr(getattr(type(m), "forward", None), "__code__", None)
    if code is None or set(code.co_names) != {"down_proj", "act_fn", "gate_proj", "up_proj"}:
        return False
    return _is_silu(getattr(m, "act_fn", None)) and all(
        _is_projection(getattr(m, r, None)) for r in ("gate_proj", "up_proj", "down_proj"))


def _is_silu(act: Any) -> bool:
    try:
        from transformers.activations import SiLUActivation  # what ACT2FN["silu"] builds in transformers 5
    except ImportError:
        SiLUActivation = torch.nn.SiLU
    return isinstance(act, torch.nn.SiLU | SiLUActivation)


def _dist_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "?"


def install(model: Any) -> PatchReport:
    """Replace Unsloth's fused LoRA functions on this model's layers by ours (see the module doc)."""
    try:
        import unsloth
        fl = _fast_lora()
    except Exception as e:
        return PatchReport("unavailable", f"unsloth not importable: {type(e).__name__}: {e}"[:300])
    version = getattr(unsloth, "__version__", None) or _dist_version("unsloth")
    missing = [n for n in _NEEDED if not hasattr(fl, n)]
    if version != UNSLOTH_VERSION or missing:
        return PatchReport("unavailable", f"written against Unsloth {UNSLOTH_VERSION}, found {version}"
                                          + (f" without {', '.join(missing)}" if missing else ""))
    rep = PatchReport("native", "no fused Unsloth LoRA layer: PEFT's forwards call the FP8 base modules")
    for name, m in model.named_modules():
        if m.__dict__.get("apply_qkv") is fl.apply_lora_qkv:
            m._ns_orig_apply_qkv, m.apply_qkv = fl.apply_lora_qkv, fp8_apply_qkv
            rep.qkv += 1
        elif _unfused_qkv(m) and _bindable(m, ("q_proj", "k_proj", "v_proj")):
            m._ns_orig_apply_qkv, m.apply_qkv = m.__dict__.get("apply_qkv", _qkv_as_modules), fp8_apply_qkv
            rep.qkv += 1
        if m.__dict__.get("apply_o") is fl.apply_lora_o:
            m._ns_orig_apply_o, m.apply_o = fl.apply_lora_o, fp8_apply_o
            rep.o += 1
        over = _mlp_override(m)
        if over is None and _unfused_swiglu(m) and _bindable(m, ("gate_proj", "up_proj", "down_proj")):
            m._ns_orig_mlp = types.MethodType(type(m).forward, m)
            m.forward = types.MethodType(fp8_apply_mlp, m)
            rep.mlp += 1
        elif over is not None:
            attr, f = over
            func = getattr(f, "__func__", None)
            if func is fl.apply_lora_mlp_swiglu:
                m._ns_orig_mlp = f
                setattr(m, attr, types.MethodType(fp8_apply_mlp, m))
                rep.mlp += 1
            elif func is not fp8_apply_mlp and getattr(func, "__module__", "").startswith("unsloth"):
                rep.left[name] = f"{getattr(func, '__name__', func)}: only the SwiGLU MLP has an FP8 kernel"
    if rep.qkv + rep.o + rep.mlp:
        rep.status, rep.detail = "patched", f"Unsloth {version}: fused LoRA layers run the FP8 Functions"
    return rep


def route(parent: Any, kind: str) -> tuple[str, str]:
    """How `parent`'s projections of this kind are computed: ("fused", "") through our patched function,
    ("modules", "") through PEFT's module forwards, or ("blocked", why) through a function we did not
    replace (its projections must stay as they are)."""
    if kind in ("qkv", "o"):
        attr = "apply_qkv" if kind == "qkv" else "apply_o"
        f = parent.__dict__.get(attr)
        ours = fp8_apply_qkv if kind == "qkv" else fp8_apply_o
        if f is None or getattr(f, "__name__", "") == f"original_{attr}":
            return "modules", ""
        if f is ours:
            return "fused", ""
        return "blocked", f"{attr} is {getattr(f, '__module__', '?')}.{getattr(f, '__name__', f)} (not patched)"
    over = _mlp_override(parent)
    if over is None:
        return "modules", ""
    func = getattr(over[1], "__func__", None)
    if func is fp8_apply_mlp:
        return "fused", ""
    return "blocked", f"MLP forward is {getattr(func, '__name__', over[1])} (not patched)"
