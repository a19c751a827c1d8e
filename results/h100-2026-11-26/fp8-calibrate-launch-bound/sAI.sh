#!/usr/bin/env bash
# issue 16: the 8B's FP8 rate through the product on another H200 host, with the host's CPU and launch costs recorded:
# the bench (FP8, which also builds the model), the product's `nightshift calibrate --seconds 20` with compute = "fp8"
# under max_vram_gb = 40, the bench again with Triton's kernels already compiled.
set -u
R=/tmp/sAI; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
timeout 60 python3 results/tmp/launch_rate.py $R/launch.json
for v in first; do
  echo "=== bench $v $(date +%T)"; s=$(date +%s)
  timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAI \
    --out $R/b8-$v > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
done
sed "s#/tmp/sAF#$R#" results/h200-2026-11-26/lora-add-kernel/cal8.toml > $R/cal8.toml
echo "=== calibrate 8B fp8 $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m daemon --config $R/cal8.toml calibrate --seconds 20 --no-checkpointing-line \
  --out $R/calibrate-8b-fp8 > $R/calibrate-8b-fp8.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"; grep "stalled\|tok/s" $R/calibrate-8b-fp8.log | tail -4
rm -rf $R/state
echo "=== bench second $(date +%T)"; s=$(date +%s)
timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
  --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAI2 \
  --out $R/b8-second > $R/bench8-second.log 2>&1
echo "bench second exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-second.log
touch $R/DONE
