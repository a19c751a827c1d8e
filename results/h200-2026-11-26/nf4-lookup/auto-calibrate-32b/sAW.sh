#!/usr/bin/env bash
# issue 16: the default config ([train] fp8_storage = "auto") through nightshift calibrate of Qwen3-32B under 72 GB,
# twice on one state directory and data (run-to-run variation was the 4,500's trouble), on whichever H200 host comes.
set -u
R=/tmp/sAW; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
head -2 $R/gpu.txt; grep "Model name" $R/gpu.txt
echo "=== build 32B $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m jobs.bench.model --path /tmp/models/qwen3-32b-nf4 --arch qwen3-32b --build-4bit --result $R/model32.json > $R/model32.log 2>&1
echo "build exit $? in $(( $(date +%s) - s )) s"
cat > $R/cal.toml <<TOML
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
for run in 1 2; do
  echo "=== calibrate run $run $(date +%T)"; s=$(date +%s)
  timeout 500 python3 -m daemon --config $R/cal.toml calibrate --seconds 20 --no-checkpointing-line \
    --out $R/calibrate-$run > $R/calibrate-$run.log 2>&1
  echo "calibrate run $run exit $? in $(( $(date +%s) - s )) s"; grep "stalled\|tokens_per_second" $R/calibrate-$run.log | cut -c1-330
  grep -o "'storage_why': '[^']*'" $R/calibrate-$run.log | head -1
done
touch $R/DONE
