#!/usr/bin/env bash
# issue 16 (and 13's Fixstars 32B): with every frozen projection on FP8 and rows packed best-fit from a lookahead,
# side by side in one run each: Llama-3.1-8B under max_vram_gb = 40 and Qwen3-32B (NF4 built directly) under 72,
# ours FP8 against ours bf16 QLoRA on both length profiles (5 warm-up steps, up to 20 s); then the product's own
# `nightshift calibrate` of the 32B with compute = "fp8" under max_vram_gb = 72.
set -u
R=/tmp/sY; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== bench 32B $(date +%T)"; s=$(date +%s)
timeout 900 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8,bf16 \
  --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stY \
  --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"
echo "=== bench 8B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8,bf16 \
  --max-vram-gb 40 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stY8 \
  --out $R/b8 > $R/bench8.log 2>&1
echo "bench 8B exit $? in $(( $(date +%s) - s )) s"
cat > $R/cal32.toml <<TOML
state_dir = "$R/state"
[model]
path = "/tmp/models/qwen3-32b-nf4"
name = "q32"
[[sources]]
name = "inbox"
inbox = "$R/inbox"
[train]
backend = "auto"
batching = "packed"
compute = "fp8"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = 72
TOML
echo "=== calibrate 32B fp8 $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m daemon --config $R/cal32.toml calibrate --seconds 20 --no-checkpointing-line \
  --out $R/calibrate-32b-fp8 > $R/calibrate-32b-fp8.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
for f in $R/b32/*.md $R/b8/*.md; do echo "--- $f"; cat $f; done
touch $R/DONE
