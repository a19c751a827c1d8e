#!/usr/bin/env bash
# issue 16: where the 8B's FP8 step goes on each length profile (3 steps under torch.profiler, one H200), then the
# product's `nightshift calibrate --seconds 20` of the same 8B with compute = "fp8" under max_vram_gb = 40.
set -u
R=/tmp/sAA; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== bench 8B profiled $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
  --seconds 10 --warmup 5 --fp8-learnable-steps 0 --torch-profile $R/prof --models-dir /tmp/models \
  --state-dir /tmp/stAA --out $R/b8 > $R/bench8.log 2>&1
echo "bench exit $? in $(( $(date +%s) - s )) s"
cat > $R/cal8.toml <<TOML
state_dir = "$R/state"
[model]
path = "/tmp/models/llama3.1-8b"
name = "m8"
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
max_vram_gb = 40
TOML
echo "=== calibrate 8B fp8 $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m daemon --config $R/cal8.toml calibrate --seconds 20 --no-checkpointing-line \
  --out $R/calibrate-8b-fp8 > $R/calibrate-8b-fp8.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
rm -rf $R/state
touch $R/DONE
