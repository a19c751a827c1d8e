"""Real model architectures by name, built random-initialised into a local HF directory.

Why: throughput depends on shapes, not weights, and the GPU machine reaches no hub. A
random-initialised model of the exact architecture (config written here) gives honest
tok/s, memory and power figures with nothing downloaded. The directory holds config.json,
safetensors and a tiny word-level tokenizer (the bench feeds random token ids, so the
tokenizer only has to exist for loaders that insist on one).

`matmul_params` counts the weights a token meets in matrix products (attention, MLP or the
active experts, lm_head): QLoRA costs ~4 FLOPs per such weight per token without
recomputation, which is what MFU is measured against.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jobs.training.models.specs import ARCHITECTURES  # the table, kept apart

MARKER = "nightshift_random.json"  # written beside config.json: which arch, which dtype, random


def make_config(arch: str) -> Any:
    """A transformers config object for a named architecture."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    spec = dict(ARCHITECTURES[arch])
    model_type = spec.pop("model_type")
    spec.setdefault("pad_token_id", spec["eos_token_id"])
    return AutoConfig.for_model(model_type, **spec)


def matmul_params(config: Any) -> int:
    """Weights per token in matrix products: attention + MLP (active experts only) + lm_head."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = c.hidden_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    n_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
    if n_experts:
        top_k = getattr(c, "num_experts_per_tok", None) or getattr(c, "experts_per_token", 1)
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        mlp = top_k * 3 * h * inter + h * n_experts  # active experts (gate, up, down) + router
    else:
        mlp = 3 * h * c.intermediate_size
    return int(c.num_hidden_layers * (attn + mlp) + c.vocab_size * h)


def write_tokenizer(out_dir: Path, config: Any) -> None:
    """A word-level tokenizer over 256 words + specials: enough for loaders; ids < vocab_size."""
    make_tokenizer(config).save_pretrained(out_dir)


def make_tokenizer(config: Any) -> Any:
    """The tokenizer `write_tokenizer` saves, in memory (models built in GPU memory have no directory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)}
    specials = {"<|pad|>": 256, "<|bos|>": 257, "<|eos|>": 258, "<|unk|>": 259}
    vocab.update(specials)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok.model_max_length = 131072
    return tok


def _atomic_dir(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)


def build_random_model(
    arch: str,
    out_dir: Path | str,
    dtype: str = "bfloat16",
    *,
    device: str | None = None,
    seed: int = 0,
    load_in_4bit: bool = False,
) -> Path:
    """Write a random-initialised `arch` to out_dir (temp dir, then rename); returns out_dir.

    dtype "bfloat16" writes full weights (16 GB for an 8B). `load_in_4bit=True` writes an NF4
    bitsandbytes checkpoint directly, layer by layer, never holding the bf16 model: how a 32B
    fits a 64 GB disk. Loaders read it like any pre-quantised checkpoint.
    """
    import torch

    out_dir = Path(out_dir)
    if (out_dir / MARKER).exists():
        meta = json.loads((out_dir / MARKER).read_text())
        if meta.get("arch") == arch and meta.get("load_in_4bit") == load_in_4bit:
            return out_dir
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = make_config(arch)
    tmp = _atomic_dir(out_dir)
    try:
        torch.manual_seed(seed)
        if load_in_4bit:
            _build_4bit(config, tmp, device)
        else:
            _build_dense(config, tmp, device, getattr(torch, dtype))
        write_tokenizer(tmp, config)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "arch": arch,
                    "dtype": dtype,
                    "load_in_4bit": load_in_4bit,
                    "seed": seed,
                    "matmul_params": matmul_params(config),
                }
            )
        )
        _publish(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _build_dense(config: Any, tmp: Path, device: str, dtype: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(tmp, max_shard_size="5GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bnb_config() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.uint8,
    )


def _build_4bit(config: Any, tmp: Path, device: str) -> None:
    """Meta-device model, Linear -> bnb Linear4bit, each weight drawn on `device` and quantised at once."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import replace_with_bnb_linear
    from transformers.quantizers import AutoHfQuantizer

    qcfg = bnb_config()
    std = getattr(config, "initializer_range", 0.02)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = replace_with_bnb_linear(
        model, modules_to_not_convert=["lm_head"], quantization_config=qcfg, pre_quantized=False
    )
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = torch.empty(module.out_features, module.in_features, dtype=torch.bfloat16, device=device)
            w.normal_(0.0, std)
            module.weight = bnb.nn.Params4bit(
                w,
                requires_grad=False,
                quant_type="nf4",
                compress_statistics=True,
                quant_storage=torch.uint8,
                module=module,
            ).to(device)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(
                    torch.zeros(module.out_features, dtype=torch.bfloat16, device=device), requires_grad=False
                )
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            data = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
            if p.dim() == 1 and ("norm" in name or (name == "weight" and "norm" in type(module).__name__.lower())):
                data.fill_(1.0)
            elif p.dim() == 1:
                data.zero_()
            else:
                data.normal_(0.0, std)
            setattr(module, name, torch.nn.Parameter(data, requires_grad=False))
    quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=False)
    model.hf_quantizer = quantizer
    model.is_loaded_in_4bit = True
    model.config.quantization_config = qcfg
    model.save_pretrained(tmp, max_shard_size="5GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
