#!/usr/bin/env bash
# issue 16: Qwen3-32B under 72 GB, one run side by side: FP8 as the default config runs it (auto -> kept in NF4)
# beside bf16 QLoRA (our path without FP8), both length profiles.
set -u
R=/tmp/sAZ; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
head -2 $R/gpu.txt
echo "=== bench 32B $(date +%T)"; s=$(date +%s)
timeout 560 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8-nf4,bf16 \
  --max-vram-gb 72 --seconds 12 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAZ \
  --profiles alpaca,wiki --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench32.log
touch $R/DONE
