#!/usr/bin/env bash
# issue 13: the Fixstars workload on Qwen3-32B (the publication's recipe, Unsloth QLoRA through TRL's SFTTrainer,
# batch 32, padded; ours, packed under max_vram_gb = 72), the quick windows, within the session's device time.
set -u
R=/tmp/sN; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== workloads $(date +%T)"; s=$(date +%s)
timeout 480 python3 -m jobs.bench workloads --quick --workloads fixstars --fixstars-archs qwen3-32b --deadline 450 \
  --models-dir /tmp/models --state-dir /tmp/stN --out $R/wl > $R/workloads.log 2>&1
echo "workloads exit $? in $(( $(date +%s) - s )) s"
touch $R/DONE
