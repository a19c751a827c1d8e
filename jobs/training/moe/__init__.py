"""Mixture-of-experts bases: LoRA that reaches the experts (and the proof that it trained them), experts
frozen in NF4, packed attention with sinks, and a model too large for the disk built in GPU memory and loaded."""
