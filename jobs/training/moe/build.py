"""A random-initialised model built directly in (GPU) memory, 4-bit, layer by layer: no checkpoint on disk.

Why: GPT-OSS-120B in NF4 is ~61 GB of weights; with its tokenizer and config that outgrows the 64 GB disk
of a one-GPU machine, and writing then re-reading 61 GB would cost minutes of a short lease anyway. The
GPU (141 GB on an H200) holds it easily, so the model is built where it is used:

1. the architecture is instantiated on the meta device (no memory);
2. layer by layer, every weight is drawn at random on the device and quantised at once: nn.Linear layers
   (attention) become bitsandbytes NF4 Linear4bit, fused expert weights become NF4 chunks of whole experts
   (jobs/training/moe/experts_nf4.py), so at most one chunk (<= 1 GB) ever exists in bf16;
3. embeddings, norms, routers, sinks, biases and lm_head are materialised in bf16 (as bitsandbytes leaves
   them), rotary tables recomputed on the device;
4. the tokenizer is the benchmark's word-level one, built in memory.

The result is a plain transformers model object: jobs/training/moe/load.py turns it into the training
path's `Loaded` (LoRA on attention and experts, packed attention), so the benchmark (and a night) can
start from an object instead of a directory. Random weights suffice: throughput, memory and power depend
on shapes, not on what the weights say.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from jobs.training.models.architectures import make_config, make_tokenizer, matmul_params
from jobs.training.moe.experts_nf4 import EXPERT_WEIGHTS, DenseWeight, NF4Weight, replace_experts

log = structlog.get_logger("nightshift.train")
GB = 1e9


def build_random_in_memory(
    arch: str, *, device: Any = None, seed: int = 0, quantize: bool | None = None,
    on_layer: Callable[[int, int, float], None] | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info) for a named architecture (jobs.training.models.architectures), on `device`.

    quantize (default: on CUDA): NF4 attention and experts; else the weights stay dense (CPU tests).
    on_layer(i, layers, seconds): progress after each decoder layer.
    """
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    config = make_config(arch)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quantize = device.type == "cuda" if quantize is None else quantize
    if quantize:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise RuntimeError("building a 4-bit model in memory needs bitsandbytes (pip install -e '.[gpu]')") from e
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ctx = _Build(device=device, dtype=dtype, std=float(getattr(config, "initializer_range", 0.02)),
                 gen=torch.Generator(device=device).manual_seed(seed), quantize=quantize, config=config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = _decoder_layers(model)
    for i, layer in enumerate(layers):
        t = time.perf_counter()
        ctx.materialise(layer)
        if on_layer is not None:
            on_layer(i, len(layers), time.perf_counter() - t)
    ctx.materialise(model, skip=layers)
    ctx.rotary(model)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"in-memory build of {arch}: still on the meta device: {left[:5]}")
    model.requires_grad_(False)
    model.config.use_cache = False
    tok = make_tokenizer(config)
    info: dict[str, Any] = {
        "arch": arch, "built_in_memory": True, "device": str(device), "quantized": "nf4" if quantize else "none",
        "build_seconds": round(time.perf_counter() - t0, 1), "layers": len(layers),
        "logical_parameters": sum(p.numel() for p in model.parameters()),
        "matmul_params": matmul_params(config), "expert_weights_gb": round(ctx.expert_bytes / GB, 2),
        "quantized_linear_layers": ctx.linear4bit,
    }
    if device.type == "cuda":
        info["gpu_allocated_gb"] = round(torch.cuda.memory_allocated(device) / GB, 2)
        info["gpu_build_peak_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 2)
    log.info("built_in_memory", **info)
    return model, tok, info


def _decoder_layers(model: Any) -> Any:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found (model.get_decoder().layers)")
    return layers


class _Build:
    def __init__(self, *, device: Any, dtype: Any, std: float, gen: Any, quantize: bool, config: Any) -> None:
        self.device, self.dtype, self.std, self.gen = device, dtype, std, gen
        self.quantize, self.config = quantize, config
        self.expert_bytes = 0
        self.linear4bit = 0

    def randn(self, shape: Any, dtype: Any = None) -> Any:
        import torch

        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device=self.device).normal_(
            0.0, self.std, generator=self.gen)

    def materialise(self, root: Any, skip: Any = None) -> None:
        """Every meta weight under `root` (not under `skip`): experts, Linear (4-bit), then the rest."""
        import torch

        output = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
        skipped = {id(m) for m in skip.modules()} if skip is not None else set()
        for name, module in list(root.named_modules()):
            if id(module) in skipped or not _has_meta(module):
                continue
            parent, leaf = _parent(root, name)
            if _is_fused_experts(name, module):
                self.experts(parent, leaf, module)
            elif isinstance(module, torch.nn.Linear) and module is not output and self.quantize \
                    and not _is_router(leaf, module, self.config):
                self.linear4bit_(parent, leaf, module)
            else:
                self.plain(module)

    def experts(self, parent: Any, leaf: str, module: Any) -> None:
        import torch

        weights: dict[str, Any] = {}
        biases: dict[str, Any] = {}
        for w in EXPERT_WEIGHTS:
            p = getattr(module, w, None)
            if p is None or p.dim() != 3:
                continue
            if self.quantize:
                weights[w] = NF4Weight.random(tuple(p.shape), std=self.std, device=self.device, generator=self.gen)
            else:
                weights[w] = DenseWeight(self.randn(p.shape))
            self.expert_bytes += weights[w].nbytes
            b = getattr(module, f"{w}_bias", None)
            if b is not None:
                biases[f"{w}_bias"] = torch.zeros(tuple(b.shape), dtype=self.dtype, device=self.device)
        replace_experts(parent, leaf, module, weights, biases)

    def linear4bit_(self, parent: Any, leaf: str, module: Any) -> None:
        import bitsandbytes as bnb
        import torch

        with torch.device("meta"):
            q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                  compute_dtype=self.dtype, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8)
        q.weight = bnb.nn.Params4bit(self.randn((module.out_features, module.in_features)), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8,
                                     module=q).to(self.device)
        if module.bias is not None:
            q.bias = torch.nn.Parameter(torch.zeros(module.out_features, dtype=self.dtype, device=self.device),
                                        requires_grad=False)
        setattr(parent, leaf, q)
        self.linear4bit += 1

    def plain(self, module: Any) -> None:
        """Own parameters of a module: norms 1, biases 0, the rest normal(0, std)."""
        import torch

        norm = "norm" in type(module).__name__.lower()
        for pname, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if norm and pname == "weight":
                data = torch.ones(tuple(p.shape), dtype=self.dtype, device=self.device)
            elif p.dim() == 1 and pname.endswith("bias") and "router" not in type(module).__name__.lower():
                data = torch.zeros(tuple(p.shape), dtype=self.dtype, device=self.device)
            else:
                data = self.randn(p.shape)
            setattr(module, pname, torch.nn.Parameter(data, requires_grad=False))

    def rotary(self, model: Any) -> None:
        """Rotary tables are buffers computed at construction: construct those modules again on the device."""
        import torch

        for name, module in list(model.named_modules()):
            if not any(b.is_meta for b in module.buffers(recurse=False)):
                continue
            if "rotary" not in type(module).__name__.lower():
                raise RuntimeError(f"in-memory build: {name} ({type(module).__name__}) has buffers on the meta device")
            parent, leaf = _parent(model, name)
            with torch.device(self.device):
                setattr(parent, leaf, type(module)(config=getattr(module, "config", self.config)))


def _has_meta(module: Any) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def _parent(root: Any, name: str) -> tuple[Any, str]:
    if "." not in name:
        return root, name
    head, leaf = name.rsplit(".", 1)
    return root.get_submodule(head), leaf


def _is_fused_experts(name: str, module: Any) -> bool:
    return name.endswith("experts") and any(
        getattr(module, w, None) is not None and getattr(module, w).dim() == 3 for w in EXPERT_WEIGHTS)


def _is_router(leaf: str, module: Any, config: Any) -> bool:
    from jobs.training.moe.lora import ROUTER_LEAVES, num_experts

    return leaf in ROUTER_LEAVES and module.out_features == num_experts(config)
