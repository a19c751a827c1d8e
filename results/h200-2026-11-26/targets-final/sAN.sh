#!/usr/bin/env bash
# issue 16: the code as it stands (34280ac) on whichever H200 host comes: the 8B FP8 bench and FP8 beside bf16 QLoRA
# (one run), nightshift calibrate of the 8B (FP8, 40 GB); Qwen3-32B bench FP8 and nightshift calibrate (FP8, 72 GB).
set -u
R=/tmp/sAN; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== bench 8B fp8,bf16 $(date +%T)"; s=$(date +%s)
NS_STEPLOG=$R/steps-b8.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH timeout 400 python3 -m jobs.bench bench \
  --arch llama3.1-8b --stacks ours --compute fp8,bf16 --max-vram-gb 40 --seconds 15 --warmup 5 --fp8-learnable-steps 0 \
  --models-dir /tmp/models --state-dir /tmp/stAN --out $R/b8 > $R/bench8.log 2>&1
echo "bench 8B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8.log
cal() {  # $1 name, $2 model path, $3 GB
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
cal m8 /tmp/models/llama3.1-8b 40
echo "=== bench 32B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8 \
  --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAN32 \
  --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32.log
cal q32 /tmp/models/qwen3-32b-nf4 72
touch $R/DONE
