#!/usr/bin/env bash
# issues 13 and 16: the Exxact workload, ours once per compute (bf16; every frozen projection on FP8, LoRA-wrapped
# or not) beside the publication's recipe (HF Trainer + PEFT LoRA bf16 r=16 on q,v, seq 512, batch 2, 60 steps),
# one run, after the FP8 GPU tests; longer windows than --quick's (8 warm-up steps, up to 60 steps or 15 s).
set -u
R=/tmp/sW; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/tests.log
echo "=== workloads $(date +%T)"; s=$(date +%s)
timeout 540 python3 -m jobs.bench workloads --quick --workloads exxact --compute bf16,fp8 --fp8-learnable-steps 0 \
  --warmup 8 --max-steps 60 --seconds 15 --data-tokens 1000000 \
  --deadline 520 --models-dir /tmp/models --state-dir /tmp/stW --out $R/wl > $R/workloads.log 2>&1
echo "workloads exit $? in $(( $(date +%s) - s )) s"
cat $R/wl/workloads.md 2>/dev/null
touch $R/DONE
