"""What a trained night leaves behind, by method: a LoRA adapter, or a whole model directory.

qlora / lora: the adapter (`adapter_config.json`, `adapter_model.safetensors`), served on the base.
full: config, generation config, safetensors shards of at most SHARD and the tokenizer: a model
directory any transformers / vLLM / SGLang loads as it is.
"""

from __future__ import annotations

from pathlib import Path

from jobs.training.load import Loaded

SHARD = "5GB"  # transformers 5 writes one 50 GB file by default: shards copy, hash and resume better


def save_version(loaded: Loaded, path: Path) -> None:
    if loaded.method.is_adapter:
        loaded.model.save_pretrained(str(path))
        return
    loaded.model.save_pretrained(str(path), max_shard_size=SHARD)
    loaded.tokenizer.save_pretrained(str(path))
