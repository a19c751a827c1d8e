#!/usr/bin/env bash
# issue 16: with the LoRA adds as a Triton kernel and the quantisation's block fitted to its inputs — the LoRA-add GPU
# tests; Qwen3-32B under max_vram_gb = 72 (bench FP8 and bf16 QLoRA side by side, the product's calibrate with
# compute = "fp8", the bench's FP8 with the code before); Llama-3.1-8B under 40 (bench FP8 and bf16 QLoRA side by side).
set -u
R=/tmp/sAG; mkdir -p $R/inbox $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_lora_add.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
for f in fp8_lora fp8 fp8_quant_kernel; do cp jobs/training/$f.py $R/new/; done
echo "=== bench 32B new $(date +%T)"; s=$(date +%s)
timeout 900 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8,bf16 \
  --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stG \
  --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench32.log
cat > $R/cal32.toml <<TOML
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
echo "=== calibrate 32B fp8 $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m daemon --config $R/cal32.toml calibrate --seconds 20 --no-checkpointing-line \
  --out $R/calibrate-32b-fp8 > $R/calibrate-32b-fp8.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"; grep "stalled\|tokens_per_second" $R/calibrate-32b-fp8.log | cut -c1-300
rm -rf $R/state
cp results/tmp/before_AF/*.py jobs/training/
echo "=== bench 32B before $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8 \
  --max-vram-gb 72 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stG2 \
  --out $R/b32-before > $R/bench32-before.log 2>&1
echo "bench 32B before exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32-before.log
cp $R/new/*.py jobs/training/
echo "=== bench 8B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8,bf16 \
  --max-vram-gb 40 --seconds 20 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stG8 \
  --out $R/b8 > $R/bench8.log 2>&1
echo "bench 8B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8.log
touch $R/DONE
