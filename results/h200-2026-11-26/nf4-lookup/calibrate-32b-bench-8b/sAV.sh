#!/usr/bin/env bash
# issue 16: the fourth NF4 kernel through the product's own command: nightshift calibrate of Qwen3-32B under 72 GB with
# fp8_storage = "nf4", then the e4m3 copy (same host); the 8B bench (40 GB) FP8 kept in NF4 beside the copy (one run).
set -u
R=/tmp/sAV; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
head -2 $R/gpu.txt
echo "=== build 32B $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m jobs.bench.model --path /tmp/models/qwen3-32b-nf4 --arch qwen3-32b --build-4bit --result $R/model32.json > $R/model32.log 2>&1
echo "build exit $? in $(( $(date +%s) - s )) s"
cal() {  # $1 name, $2 model path, $3 GB, $4 storage
  cat > $R/cal-$1.toml <<TOML
state_dir = "$R/state-$1"
[model]
path = "$2"
name = "$1"
[[sources]]
name = "inbox"
inbox = "$R/inbox"
[train]
backend = "auto"
batching = "packed"
compute = "fp8"
fp8_storage = "$4"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = $3
TOML
  echo "=== calibrate $1 $(date +%T)"; local s=$(date +%s)
  timeout 500 python3 -m daemon --config $R/cal-$1.toml calibrate --seconds 20 --no-checkpointing-line \
    --out $R/calibrate-$1 > $R/calibrate-$1.log 2>&1
  echo "calibrate $1 exit $? in $(( $(date +%s) - s )) s"; grep "stalled\|tokens_per_second" $R/calibrate-$1.log | cut -c1-400
  rm -rf $R/state-$1
}
cal q32-nf4 /tmp/models/qwen3-32b-nf4 72 nf4
cal q32-fp8 /tmp/models/qwen3-32b-nf4 72 fp8
echo "=== bench 8B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8-nf4,fp8 \
  --max-vram-gb 40 --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAV \
  --out $R/b8 > $R/bench8.log 2>&1
echo "bench 8B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8.log
touch $R/DONE
