#!/usr/bin/env bash
# issue 16: the NF4 -> e4m3 kernel with per-(row, block) tables looked up by prmt (fourth version): the GPU tests of
# every Triton kernel (first GPU run of the restructured _jit() modules); the kernel micro-benchmark beside the
# committed second version, with a tile sweep; Qwen3-32B under 72 GB FP8 kept in NF4 beside the e4m3 copy (one run).
set -u
R=/tmp/sAU; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
head -2 $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8_nf4.py tests/training/test_gpu_fp8.py \
  tests/training/test_gpu_lora_add.py tests/training/test_gpu_fp8_quant.py tests/training/test_gpu_oom.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/tests.log
echo "=== kernel bench $(date +%T)"; s=$(date +%s)
NF4_SWEEP=1 timeout 200 python3 results/tmp/nf4bench.py nf4_fp8_kernel_v2b jobs.training.nf4_fp8_kernel > $R/nf4bench.txt 2>&1
echo "kernel bench exit $? in $(( $(date +%s) - s )) s"; cat $R/nf4bench.txt | grep -v Warn | head -40
echo "=== bench 32B $(date +%T)"; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch qwen3-32b --build-4bit --stacks ours --compute fp8-nf4,fp8 \
  --max-vram-gb 72 --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAU \
  --profiles alpaca,wiki --out $R/b32 > $R/bench32.log 2>&1
echo "bench 32B exit $? in $(( $(date +%s) - s )) s"; grep "^| nightshift" $R/bench32.log
touch $R/DONE
