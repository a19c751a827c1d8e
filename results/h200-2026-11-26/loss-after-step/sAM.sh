#!/usr/bin/env bash
# issue 16: the training step reads its loss after the optimizer step (one wait for the GPU a step, not two) and clips
# the optimizer's weights (no scan of the model's parameters a step), against the step at 9b51d40
# (results/tmp/before_AM/step.py), one machine: the OOM GPU tests; the 8B FP8 bench new / before / new / before;
# nightshift calibrate of the 8B (FP8, 40 GB); Qwen3-32B: bench FP8 (builds the 4-bit model) and calibrate (FP8, 72 GB).
set -u
R=/tmp/sAM; mkdir -p $R/inbox $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_oom.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
cp jobs/training/step.py $R/new/
bench() {
  local v=$1
  echo "=== bench $v $(date +%T)"; local s=$(date +%s)
  NS_STEPLOG=$R/steps-$v.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH timeout 300 python3 -m jobs.bench bench \
    --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 --seconds 15 --warmup 5 --fp8-learnable-steps 0 \
    --models-dir /tmp/models --state-dir /tmp/stAM --out $R/b8-$v > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
}
for v in new before new2 before2; do
  case $v in before*) cp results/tmp/before_AM/step.py jobs/training/;; *) cp $R/new/step.py jobs/training/;; esac
  bench $v
done
cp $R/new/step.py jobs/training/
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
  --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAM32 \
  --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32.log
cal q32 /tmp/models/qwen3-32b-nf4 72
touch $R/DONE
