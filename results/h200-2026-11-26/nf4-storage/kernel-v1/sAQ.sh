#!/usr/bin/env bash
# issue 16: FP8 bases kept in NF4 (fp8_storage = "nf4"): the new GPU tests; Qwen3-32B (72 GB) bench FP8 kept in NF4
# beside FP8 as an e4m3 copy (one run); the 8B (40 GB) bench the same two beside bf16 QLoRA (one run).
set -u
R=/tmp/sAQ; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8_nf4.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/tests.log
echo "=== bench 32B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8-nf4,fp8-e4m3 \
  --max-vram-gb 72 --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAQ \
  --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench32.log
echo "=== bench 8B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8-nf4,fp8-e4m3,bf16 \
  --max-vram-gb 40 --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAQ \
  --out $R/b8 > $R/bench8.log 2>&1
echo "bench 8B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench8.log
touch $R/DONE
