#!/usr/bin/env bash
# issues 13 and 16: Fixstars' Qwen3-8B workload, ours once per compute (bf16 QLoRA; every frozen projection on FP8)
# beside the publication's recipe (Unsloth QLoRA through TRL's SFTTrainer, padded batch 4, Unsloth checkpointing),
# one run, after rows are packed best-fit from a lookahead; 3 warm-up steps, up to 20 steps or 12 s.
set -u
R=/tmp/sAB; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== workloads $(date +%T)"; s=$(date +%s)
timeout 1100 python3 -m jobs.bench workloads --quick --workloads fixstars \
  --compute bf16,fp8 --fp8-learnable-steps 0 --warmup 3 --max-steps 20 --seconds 12 --deadline 1050 \
  --models-dir /tmp/models --state-dir /tmp/stAB --out $R/wl > $R/workloads.log 2>&1
echo "workloads exit $? in $(( $(date +%s) - s )) s"
cat $R/wl/workloads.md 2>/dev/null
touch $R/DONE
