"""The stacks the benchmark measures: name -> what it measures (a table only: the settings validate
names against it, the worker dispatch in benchmarks/stacks imports the module of the same name)."""

from __future__ import annotations

WORKERS = {  # name -> what it measures
    "ours": "nightshift: packed rows to a budget chosen from measured memory, varlen attention",
    "ours_lora": "nightshift with method lora: the same path on a bf16 base (no NF4 dequantisation)",
    "baseline": "HF transformers + PEFT + bitsandbytes NF4, gradient checkpointing on, batch 4 padded",
    "unsloth": "Unsloth defaults (its offloaded checkpointing), batch 4 padded",
    "trl": "Unsloth + TRL SFTTrainer: padding_free with a large batch, and packing=True",
    "trl_liger": "TRL SFTTrainer + Liger Kernel (use_liger_kernel) on HF + PEFT + bitsandbytes NF4, packing=True",
    "first_step": "faststart: a night's load and first step, timed from launch",
    "moe": "MoE (--in-memory): NF4 model built in GPU memory, LoRA on attention + experts, packed; expert check",
    "budget": "calibrate on one profile, then plan and train other sizes: predicted vs actual time",
    # the published runs (benchmarks/workloads.py), each recipe beside ours
    "w_hf": "exxact + alpaca recipe: HF transformers Trainer + PEFT, LoRA bf16 r=16 on q,v",
    "w_ours_lora": "exxact + alpaca, ours: method lora (bf16 base), packed, budget from memory",
    "w_fixstars": "fixstars recipe: Unsloth QLoRA r=8 + TRL SFTTrainer, padded, Unsloth checkpointing",
    "w_ours_qlora": "fixstars, ours: method qlora, packed, budget from memory",
    "w_full": "full recipe: Unsloth full fine-tuning + TRL SFTTrainer under a hard memory cap",
    "w_ours_full": "full, ours: method full, optimizer and budget from memory under the same cap",
    # scaling (benchmarks/scaling.py): 1 vs N GPUs through torchrun
    "scaling_ours": "scaling: our path on the ranks of a torchrun group, gradients reduced once per step",
    "exxact": "scaling: the Exxact recipe, HF LoRA bf16 r=16 on q,v, seq 512, batch 2 per GPU, DDP",
}
