#!/usr/bin/env bash
# issue 16: why this host's FP8 steps run slower than another H200's: its CPU and launch costs, and the 8B FP8 step
# under the profiler (idle share, launches a step) on both profiles.
set -u
R=/tmp/sAH; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
timeout 60 python3 results/tmp/launch_rate.py $R/launch.json
echo "=== bench 8B profiled $(date +%T)"; s=$(date +%s)
timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
  --seconds 10 --warmup 5 --fp8-learnable-steps 0 --torch-profile $R/prof --models-dir /tmp/models \
  --state-dir /tmp/stAH --out $R/b8 > $R/bench8.log 2>&1
echo "bench exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8.log; head -12 $R/prof*.txt
touch $R/DONE
