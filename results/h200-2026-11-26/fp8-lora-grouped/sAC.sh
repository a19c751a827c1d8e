#!/usr/bin/env bash
# issue 16: the FP8 LoRA Functions with each group's LoRA products as one GEMM (x A^T of q/k/v and of gate/up,
# dA, dx's LoRA share) against the same Functions as they were (fp8_lora_before.py), one machine, one call:
# the FP8 GPU tests, then the 8B bench (FP8, both profiles) with the new Functions, then with the old ones.
set -u
R=/tmp/sAC; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
cp jobs/training/fp8_lora.py $R/fp8_lora_grouped.py
for v in grouped before grouped2; do
  f=${v%2}; cp $R/fp8_lora_$f.py jobs/training/fp8_lora.py 2>/dev/null || cp results/tmp/fp8_lora_before.py jobs/training/fp8_lora.py
  echo "=== bench $v $(date +%T)"; s=$(date +%s)
  timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAC \
    --out $R/b8-$v > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
done
cp $R/fp8_lora_grouped.py jobs/training/fp8_lora.py
touch $R/DONE
