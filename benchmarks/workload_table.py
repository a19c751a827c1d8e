"""The four published fine-tuning runs nightshift is built from: each recipe, its published figure and how
ours runs the same work (a table only: the settings validate names against it, the run and the report
read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    recipe: str  # the publication's, as it published it
    published: str  # its figure
    ours: str  # how ours runs the same work
    differ: tuple[str, ...]  # where the two recipes differ (and what we had to assume)
    headline: str  # the figure the ratio is taken on: real_tok_s | samples_per_hour | job_seconds


COMMON = "random-initialised weights and random tokens (speed depends on shapes, not values)"
WORKLOADS: dict[str, Workload] = {
    "exxact": Workload(
        "exxact", "Exxact: Llama-3.1-8B, LoRA bf16",
        "HF transformers Trainer + PEFT, LoRA r=16 on q_proj and v_proj, bf16 base, 512-token sequences, batch 2, "
        "60 steps", "4,962 tok/s on one RTX PRO 6000 Server Edition",
        "method lora: the bf16 base through Unsloth, the same adapter and sequences, packed into rows of a token "
        "budget probed under --max-vram-gb, varlen attention, no checkpointing",
        ("ours packs the 512-token sequences into budgeted rows; the recipe steps 2 x 512 tokens",
         "ours runs Unsloth's LoRA kernels; the recipe runs PEFT on transformers' SDPA attention",
         "lora_alpha 32, dropout 0.05, learning rate 2e-4 assumed (unpublished)", COMMON),
        "real_tok_s"),
    "alpaca": Workload(
        "alpaca", "Llama-3-8B Alpaca: the whole job",
        "Llama-3-8B, LoRA bf16, 2,000 Alpaca-like samples + 200 eval, batch 16, 10 epochs, transformers Trainer",
        "594.6 s for the whole job, 61 GB, one RTX PRO 6000 Server Edition",
        "method lora on the same samples, 10 epochs of packed budgeted steps, evaluated as a night does (before "
        "and after training)",
        ("the recipe's LoRA shape is not published: r=16 on q,v assumed for both sides",
         "the recipe evaluates once per epoch (assumed); ours twice (before and after, as a night)",
         "Llama-3.1-8B shapes (identical to Llama-3-8B's but for RoPE scaling); Alpaca-like lengths: log-normal, "
         "mean 117 tokens", "scaled down unless --alpaca-whole: a timed window of steps and one timed evaluation, "
         "extrapolated to the whole job (the row says how)", COMMON),
        "job_seconds"),
    "fixstars": Workload(
        "fixstars", "Fixstars: Qwen3, Unsloth QLoRA through TRL",
        "Qwen3-8B and Qwen3-32B, Unsloth QLoRA (r=8, all linear layers) through TRL's SFTTrainer, max_seq_length "
        "2048, batch 32 (8B: 4), padded, use_gradient_checkpointing=\"unsloth\"",
        "Qwen3-32B on an H100 SXM5: 27,000 / 9,200 samples/h (data sets of mean 117 / 861 tokens)",
        "method qlora: the same adapter, packed rows to a budget probed under --max-vram-gb (72 GB for the 32B), "
        "varlen attention, no checkpointing",
        ("ours packs and drops checkpointing where memory allows; the recipe pads to the longest sample and "
         "recomputes (offloaded) activations", "lora_alpha 16 and adamw_8bit (Unsloth's default) assumed",
         "both load the same NF4 checkpoint, built directly as NF4", COMMON),
        "samples_per_hour"),
    "full": Workload(
        "full", "Full fine-tuning of an 8B under 48 GB",
        "8B full fine-tuning with Unsloth (full_finetuning=True, adamw_8bit, Unsloth checkpointing) through TRL's "
        "SFTTrainer on one 48 GB GPU", "fits 48 GB",
        "method full: Unsloth's full fine-tuning, the optimizer chosen from memory (8-bit AdamW stepped in the "
        "backward pass for an 8B under 48 GB), packed rows to a budget probed under the cap",
        ("the 48 GB is a hard cap of each process's CUDA allocator (torch.cuda.set_per_process_memory_fraction)",
         "ours steps each weight in the backward pass (no gradient clipping); the recipe holds every gradient",
         "MFU counts 6 FLOPs per parameter per token (LoRA rows: 4)", COMMON),
        "real_tok_s"),
}
