#!/usr/bin/env bash
# issue 16: the 8B's targets in one run side by side, the code as it stands (34280ac): nightshift bench FP8 beside bf16
# QLoRA twice on one state directory; the first run fills the product's compile cache (as a night's first run
# does), the second is the measurement.
set -u
R=/tmp/sAO; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
for v in first second; do
  echo "=== bench 8B fp8,bf16 $v $(date +%T)"; s=$(date +%s)
  timeout 400 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8,bf16 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAO --out $R/b8-$v \
    > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8-$v.log
done
touch $R/DONE
