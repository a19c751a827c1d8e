"""Frozen fused MoE experts in 4-bit NF4, computed with grouped GEMMs, their LoRA included.

Why: GPT-OSS-120B's experts are 114.7 B of its 116.8 B parameters. transformers' bitsandbytes integration
quantises only nn.Linear, so its fused 3-D expert weights would stay bf16 (229 GB). Here each expert
weight is stored as NF4 in chunks of whole experts (bitsandbytes' kernels count elements in 32 bits), and
a forward dequantises one layer's weight into a transient bf16 buffer and runs one grouped GEMM over the
tokens sorted by expert (`torch.nn.functional.grouped_mm` on Hopper; a loop elsewhere). The backward
dequantises again and computes only the input gradient (the base is frozen): no dense expert weight is
kept for the backward, so activations, not weights, set the memory of a step.

LoRA on the experts is PEFT's own ParamWrapper (`target_parameters`), so adapters save and load like any
PEFT adapter. Its forward would fold B @ A into a full-size copy of the weight (and, under autograd, a
full-size weight gradient); `route_lora` instead points each wrapper's forward at the experts module,
which applies every expert's factors as two more grouped GEMMs on the same sorted tokens:
y = x W_e + s (x A_e^T) B_e^T, with A (E*r, in) -> (E, r, in) and B (out, r*E) -> (E, r, out) as PEFT
lays them out. Each wrapper keeps a 3-D stub parameter of the weight's logical shape (an expanded zero:
no memory) for PEFT to read shapes, devices and dtypes from.
"""

from __future__ import annotations

import functools
from typing import Any

CHUNK_ELEMS = 1 << 29  # elements per quantised chunk: well inside bitsandbytes' 32-bit element counts
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


class DenseWeight:
    """A frozen expert weight kept as it is (bf16/fp32): the same interface as NF4Weight (tests, CPU)."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor.detach()
        self.shape = tuple(self.tensor.shape)

    def dequantize(self, dtype: Any) -> Any:
        return self.tensor.to(dtype)

    def buffers(self) -> list[Any]:
        return [self.tensor]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class NF4Weight:
    """One fused (experts, a, b) weight as bitsandbytes NF4 (double-quantised absmax), in expert chunks."""

    def __init__(self, shape: tuple[int, int, int], chunks: list[tuple[int, int, Any, Any]]) -> None:
        self.shape = shape
        self.chunks = chunks  # (first expert, end expert, packed uint8, QuantState)
        self._out_ok = True

    @classmethod
    def quantize(cls, dense: Any) -> NF4Weight:
        """From a dense (E, a, b) tensor, chunk by chunk (the caller may free `dense` afterwards)."""
        e, a, b = dense.shape
        per = max(1, CHUNK_ELEMS // (a * b))
        return cls((e, a, b), [_quantize(dense[i : i + per], i, min(e, i + per)) for i in range(0, e, per)])

    @classmethod
    def random(cls, shape: tuple[int, int, int], *, std: float, device: Any, generator: Any = None,
               dtype: Any = None) -> NF4Weight:
        """Random normal(0, std) weights drawn chunk by chunk on `device` and quantised at once: the whole
        bf16 weight never exists (a 120B layer's gate_up alone would be 4.2 GB)."""
        import torch

        e, a, b = shape
        per = max(1, CHUNK_ELEMS // (a * b))
        chunks = []
        for i in range(0, e, per):
            j = min(e, i + per)
            w = torch.empty((j - i, a, b), dtype=dtype or torch.bfloat16, device=device)
            w.normal_(0.0, std, generator=generator)
            chunks.append(_quantize(w, i, j))
            del w
        return cls(shape, chunks)

    def dequantize(self, dtype: Any) -> Any:
        import torch
        from bitsandbytes.functional import dequantize_4bit

        out = torch.empty(self.shape, dtype=dtype, device=self.chunks[0][2].device)
        for i, j, packed, state in self.chunks:
            if state.dtype != dtype:
                out[i:j] = dequantize_4bit(packed, state).to(dtype)
                continue
            if self._out_ok:
                try:
                    dequantize_4bit(packed, state, out=out[i:j])
                    continue
                except (NotImplementedError, RuntimeError):  # no `out=` kernel on this device (the CPU)
                    self._out_ok = False
            out[i:j] = dequantize_4bit(packed, state)
        return out

    def buffers(self) -> list[Any]:
        return [c[2] for c in self.chunks]

    @property
    def nbytes(self) -> int:
        total = 0
        for _, _, packed, state in self.chunks:
            total += packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
            if getattr(state, "state2", None) is not None:
                total += state.state2.absmax.numel() * 4 + state.state2.code.numel() * 4
        return total


def _quantize(w: Any, i: int, j: int) -> tuple[int, int, Any, Any]:
    import torch
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(w.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8)
    return i, j, packed, state


def gmm(x: Any, w: Any, offs: Any) -> Any:
    """Grouped GEMM: rows of `x` sorted by group, `w` (groups, in, out), `offs` cumulative rows (int32).
    Hopper's grouped kernel for bf16 with 16-byte aligned widths; transformers' loop otherwise."""
    import torch
    from transformers.integrations.moe import _grouped_mm

    if x.is_cuda and (x.shape[-1] * 2) % 16 == 0 and (w.shape[-1] * 2) % 16 == 0 and w.dtype == torch.bfloat16:
        return _grouped_mm(x, w, offs)
    return torch.ops.transformers.grouped_mm_fallback(x.to(w.dtype), w, offs)


@functools.cache
def _grouped_frozen() -> Any:
    import torch

    class GroupedFrozen(torch.autograd.Function):
        """x (rows sorted by expert) @ W[expert] with W frozen and dequantised on use, forward and backward."""

        @staticmethod
        def forward(ctx, x, offs, weight, transposed):  # type: ignore[override]
            w = weight.dequantize(x.dtype)
            out = gmm(x, w if transposed else w.transpose(-2, -1), offs)
            ctx.weight, ctx.transposed = weight, transposed
            ctx.save_for_backward(offs)
            return out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            (offs,) = ctx.saved_tensors
            w = ctx.weight.dequantize(grad.dtype)
            grad_x = gmm(grad.contiguous(), w.transpose(-2, -1) if ctx.transposed else w, offs)
            return grad_x, None, None, None

    return GroupedFrozen


class FrozenExperts:
    """Factory of the experts module (a class built on first use: torch is imported inside functions)."""

    _cls: Any = None

    @classmethod
    def cls(cls) -> Any:
        if cls._cls is None:
            cls._cls = _make_module_class()
        return cls._cls


def _make_module_class() -> Any:
    import torch
    from torch import nn

    class NF4Experts(nn.Module):
        """Drop-in for a transformers-5 fused experts module (GptOssExperts, ...): same metadata and gate,
        frozen weights in `weights` (NF4Weight or DenseWeight), LoRA read from routed PEFT wrappers."""

        def __init__(self, like: nn.Module, weights: dict[str, Any], biases: dict[str, Any]) -> None:
            super().__init__()
            for k, v in vars(like).items():
                if not k.startswith("_") and isinstance(v, int | float | bool | str):
                    setattr(self, k, v)
            self.config = getattr(like, "config", None)
            self.num_experts = like.num_experts
            self.is_transposed = bool(getattr(like, "is_transposed", False))
            self.has_bias = bool(getattr(like, "has_bias", bool(biases)))
            self.has_gate = bool(getattr(like, "has_gate", True))
            if isinstance(getattr(like, "act_fn", None), nn.Module):
                self.act_fn = like.act_fn
            self._gate = type(like)._apply_gate if hasattr(type(like), "_apply_gate") else None
            self.frozen = weights
            self.lora: dict[str, Any] = {}
            for name, w in weights.items():
                device = w.buffers()[0].device
                stub = torch.zeros((), dtype=torch.float32, device=device).expand(*w.shape)
                self.register_parameter(name, nn.Parameter(stub, requires_grad=False))
                for i, buf in enumerate(w.buffers()):
                    self.register_buffer(f"{name}_frozen_{i}", buf, persistent=False)
            for name, b in biases.items():
                self.register_parameter(name, nn.Parameter(b, requires_grad=False))

        def _apply_gate(self, gate_up: Any) -> Any:
            if self._gate is not None:
                return self._gate(self, gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            top_k = top_k_index.shape[-1]
            tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
            expert_ids, perm = torch.sort(top_k_index.reshape(-1))
            x = hidden_states[perm // top_k]
            counts = torch.histc(expert_ids.float() if x.device.type == "cpu" else expert_ids.int(),
                                 bins=self.num_experts, min=0, max=self.num_experts - 1)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            first = "gate_up_proj" if self.has_gate else "up_proj"
            h = self._project(first, x, expert_ids, offs)
            h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
            h = self._project("down_proj", h, expert_ids, offs)
            h = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(h.dtype)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            return h[inv].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

        def _project(self, name: str, x: Any, expert_ids: Any, offs: Any) -> Any:
            out = _grouped_frozen().apply(x, offs, self.frozen[name], self.is_transposed)
            bias = getattr(self, f"{name}_bias", None) if self.has_bias else None
            if bias is not None:
                out = out + bias[expert_ids].to(out.dtype)
            wrapper = self.lora.get(name)
            if wrapper is not None:
                out = out + lora_delta(wrapper, x, offs)
            return out

    return NF4Experts


def lora_delta(wrapper: Any, x: Any, offs: Any) -> Any:
    """Sum over the wrapper's active adapters of s * (x A_e^T) B_e^T, per expert, as grouped GEMMs."""
    if getattr(wrapper, "disable_adapters", False) or getattr(wrapper, "merged", False):
        return 0
    total: Any = 0
    e = wrapper.num_experts
    for name in wrapper.active_adapters:
        if name not in wrapper.lora_A:
            continue
        a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
        r = a.shape[0] // e
        a_t = a.to(x.dtype).view(e, r, a.shape[1]).transpose(1, 2).contiguous()  # (E, in, r)
        b_t = b.to(x.dtype).view(b.shape[0], r, e).permute(2, 1, 0).contiguous()  # (E, r, out)
        total = total + gmm(gmm(x, a_t, offs), b_t, offs) * wrapper.scaling[name]
    return total


def replace_experts(parent: Any, attr: str, like: Any, weights: dict[str, Any], biases: dict[str, Any]) -> Any:
    module = FrozenExperts.cls()(like, weights, biases)
    setattr(parent, attr, module)
    return module


def is_frozen_experts(module: Any) -> bool:
    return FrozenExperts._cls is not None and isinstance(module, FrozenExperts._cls)


def route_lora(model: Any) -> int:
    """Point each outermost PEFT ParamWrapper over frozen experts at the experts' own forward (which
    applies the factors as grouped GEMMs); returns how many experts modules were routed."""
    from peft.tuners.lora.layer import ParamWrapper

    routed = 0
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, ParamWrapper) and isinstance(module.base_layer, ParamWrapper):
            inner.add(id(module.base_layer))
    for module in model.modules():
        if not isinstance(module, ParamWrapper) or id(module) in inner:
            continue
        wrappers, base = {}, module
        while isinstance(base, ParamWrapper):
            wrappers[base.parameter_name] = base
            base = base.base_layer
        if is_frozen_experts(base):
            unknown = set(wrappers) - set(base.frozen)
            if unknown:
                raise ValueError(f"LoRA targets {sorted(unknown)} are not frozen expert weights of {type(base)}")
            base.lora = wrappers
            module.forward = base.forward  # skip PEFT's fold of B @ A into a full-size weight
            routed += 1
    return routed


def quantize_experts(model: Any) -> dict[str, int]:
    """Replace every dense fused experts module of a loaded model by NF4 frozen experts (each dense weight
    is dropped as its module is replaced). Returns the bytes before and after."""
    before = after = 0
    for name, module in list(model.named_modules()):
        if not name.endswith("experts") or is_frozen_experts(module):
            continue
        weights = {w: p for w in EXPERT_WEIGHTS if (p := getattr(module, w, None)) is not None and p.dim() == 3}
        if not weights:
            continue
        nf4 = {k: NF4Weight.quantize(v.detach()) for k, v in weights.items()}
        biases = {f"{k}_bias": b.detach() for k in weights if (b := getattr(module, f"{k}_bias", None)) is not None}
        before += sum(v.numel() * v.element_size() for v in weights.values())
        after += sum(w.nbytes for w in nf4.values())
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        replace_experts(parent, name.rsplit(".", 1)[-1], module, nf4, biases)
    return {"dense_bytes": before, "nf4_bytes": after}


def self_check(device: Any, *, quantize: bool = True) -> dict[str, Any]:
    """Frozen experts' grouped GEMMs (forward and input gradient) against a per-expert loop over the same
    dequantised weights, on small random data (empty experts included). `ok` False with the error else."""
    import torch

    try:
        g = torch.Generator(device=device).manual_seed(0)
        e, k, n, rows = 8, 128, 256, [0, 40, 7, 0, 90, 16, 33, 1]
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        w = torch.randn(e, k, n, device=device, generator=g).to(dtype) * 0.05
        weight = NF4Weight.quantize(w) if quantize else DenseWeight(w)
        ref_w = weight.dequantize(dtype)
        x = torch.randn(sum(rows), k, device=device, generator=g).to(dtype).requires_grad_()
        offs = torch.tensor(rows, device=device).cumsum(0).to(torch.int32)
        out = _grouped_frozen().apply(x, offs, weight, True)
        out.float().square().sum().backward()
        x2 = x.detach().clone().requires_grad_()
        ref = torch.cat([x2[a:b] @ ref_w[i] for i, (a, b) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist(),
                                                                           strict=True))])
        ref.float().square().sum().backward()
        errs = [float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))
                for a, b in ((out.detach(), ref.detach()), (x.grad, x2.grad))]
        quant_err = float((ref_w.float() - w.float()).abs().max())
        return {"ok": max(errs) < 0.03, "max_rel_err": {"out": round(errs[0], 5), "dx": round(errs[1], 5)},
                "nf4_max_abs_err": round(quant_err, 5)}
    except Exception as ex:  # bitsandbytes or grouped_mm missing or failing
        return {"ok": False, "error": f"{type(ex).__name__}: {ex}"[:300]}
