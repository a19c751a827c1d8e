#!/usr/bin/env bash
# issue 16: our Triton kernels launched directly once compiled (jobs/training/triton_launch.py) against the JIT launch:
# the GPU tests, the launch cost on this host each way, then the 8B FP8 bench: new, JIT launch (results/tmp/before_AJ/),
# new again.
set -u
R=/tmp/sAJ; mkdir -p $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_lora_add.py \
  tests/training/test_gpu_fp8_quant.py tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
timeout 60 python3 results/tmp/launch_rate2.py $R/launch.json
for f in fp8_quant_kernel lora_add_kernel; do cp jobs/training/$f.py $R/new/; done
for v in new jit new2; do
  if [ $v = jit ]; then cp results/tmp/before_AJ/*.py jobs/training/; else cp $R/new/*.py jobs/training/; fi
  echo "=== bench $v $(date +%T)"; s=$(date +%s)
  timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAJ \
    --out $R/b8-$v > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
done
cp $R/new/*.py jobs/training/
touch $R/DONE
