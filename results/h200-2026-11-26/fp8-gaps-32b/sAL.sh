#!/usr/bin/env bash
# issue 16: where the 8B FP8 step's GPU waits (the profiled bench's chrome traces, every idle gap attributed to the
# CPU ops around the launch that ends it: results/tmp/gaps.py), then Qwen3-32B (72 GB) FP8 bench new / before
# (results/tmp/before_AK/) / new: the launch reduction where a step holds 2,304 tokens over 64 layers.
set -u
R=/tmp/sAL; mkdir -p $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
for f in fp8_lora lora_add_kernel fp8_selftest; do cp jobs/training/$f.py $R/new/; done
echo "=== bench 8B profiled $(date +%T)"; s=$(date +%s)
NS_STEPLOG=$R/steps-prof.txt NS_TRACE=$R/trace PYTHONPATH=$PWD/results/tmp/diagAL:$PYTHONPATH timeout 400 \
  python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
  --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAL \
  --out $R/b8-prof --torch-profile $R/prof > $R/bench8-prof.log 2>&1
echo "bench exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-prof.log; ls -la $R/trace* 2>&1 | head
for t in $R/trace.*.json; do echo "--- $t"; python3 results/tmp/gaps.py $t 3 | head -45; gzip -f $t; done
b32() {
  local v=$1
  echo "=== bench 32B $v $(date +%T)"; local s=$(date +%s)
  timeout 900 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8 \
    --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAL \
    --out $R/b32-$v > $R/bench32-$v.log 2>&1
  echo "bench 32B $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32-$v.log
}
b32 new
cp results/tmp/before_AK/*.py jobs/training/; b32 before
cp $R/new/*.py jobs/training/; b32 new2
touch $R/DONE
