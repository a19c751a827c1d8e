"""The architectures by name: the config values `jobs/training/models/architectures.py` builds random-initialised
models from (the real models' shapes, and small stand-ins for the tests)."""

from __future__ import annotations

from typing import Any


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.x's RoPE scaling (3.1: factor 8, 3.2: factor 32)."""
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": _llama3_rope(8.0),
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # the acceptance run's default on one GPU: a real small Llama that builds, loads and trains in seconds
    "llama3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": _llama3_rope(32.0),
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # GPT-OSS-20B's widths (32 experts, top-4, alternating sliding/full attention), 2 layers only.
    "gpt-oss-small": {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 2,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "bos_token_id": 199998,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    },
    # small Llama for GPU tests: real head_dim (128), seconds to build and load
    "small-llama": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # test-sized Llama (CPU tests)
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
# the same families at other sizes: only what differs
ARCHITECTURES["llama3.2-3b"] = {**ARCHITECTURES["llama3.2-1b"], "hidden_size": 3072, "num_hidden_layers": 28,
                                "num_attention_heads": 24, "head_dim": 128}
ARCHITECTURES["qwen3-32b"] = {**ARCHITECTURES["qwen3-8b"], "hidden_size": 5120, "intermediate_size": 25600,
                              "num_hidden_layers": 64, "num_attention_heads": 64}
# GPT-OSS-120B (issue 15): GPT-OSS-20B's widths, 36 layers, 128 experts (top-4): 116.8 B parameters, ~5.1 B
# active per token. Its NF4 weights (~61 GB) outgrow a 64 GB disk: jobs/training/moe/build.py builds it
# on the GPU. tiny-gpt-oss: the same architecture at test size (CPU tests).
ARCHITECTURES["gpt-oss-120b"] = {
    **ARCHITECTURES["gpt-oss-small"],
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}
ARCHITECTURES["tiny-gpt-oss"] = {
    **ARCHITECTURES["gpt-oss-small"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 4096,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
