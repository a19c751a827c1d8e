#!/usr/bin/env bash
# issue 11 on one H200: is the bench/calibrate gap to the nights Python's garbage collector? the bench's
# `ours` with every collection over 2 ms logged, then with the collector off, alternated; calibrate both ways.
set -u
R=/tmp/sE; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; python3 -V >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
BASE=$PYTHONPATH
i=0
for g in gcstat gcoff gcstat gcoff; do
  i=$((i+1)); stamp "bench $i $g"; s=$(date +%s)
  PYTHONPATH=$PWD/results/tmp/$g:$BASE timeout 400 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --profiles alpaca \
    --seconds 10 --warmup 5 --models-dir /tmp/models --out $R/bench$i-$g > $R/bench$i-$g.log 2>&1
  echo "bench exit $? in $(( $(date +%s) - s )) s"
  [ -d /tmp/gcstat ] && mv /tmp/gcstat $R/gcstat-bench$i
done
W=/tmp/n8; mkdir -p $W/inbox
cat > $W/n.toml <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/models/llama3.1-8b"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
[train]
backend = "auto"
batching = "packed"
compute = "bf16"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = 40
TOML
for g in gcstat gcoff; do
  stamp "calibrate $g"; s=$(date +%s)
  PYTHONPATH=$PWD/results/tmp/$g:$BASE timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate-$g > $R/calibrate-$g.log 2>&1
  echo "calibrate exit $? in $(( $(date +%s) - s )) s"
  [ -d /tmp/gcstat ] && mv /tmp/gcstat $R/gcstat-calibrate
done
stamp done
touch $R/DONE
