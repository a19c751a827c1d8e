#!/usr/bin/env bash
# issues 13 and 16: the Exxact workload with ours once per compute (bf16 and the frozen base on FP8) beside the
# publication's recipe (HF Trainer + PEFT LoRA bf16 r=16 on q,v, seq 512, batch 2), the quick windows, one run.
set -u
R=/tmp/sV; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== workloads $(date +%T)"; s=$(date +%s)
timeout 500 python3 -m jobs.bench workloads --quick --workloads exxact --compute bf16,fp8 --fp8-learnable-steps 0 \
  --deadline 470 --models-dir /tmp/models --state-dir /tmp/stV --out $R/wl > $R/workloads.log 2>&1
echo "workloads exit $? in $(( $(date +%s) - s )) s"
cat $R/wl/workloads.md 2>/dev/null
touch $R/DONE
