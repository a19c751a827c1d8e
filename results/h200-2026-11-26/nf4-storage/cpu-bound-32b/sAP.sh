#!/usr/bin/env bash
# issue 16: the mended code's GPU tests; then where Qwen3-32B's FP8 step goes (72 GB): the bench twice on one state
# directory (first fills the compile cache), at half the token budget (1,152) and with room for more tokens
# (max_vram_gb 90): the step time's fixed part against its per-token part; one profiled run with idle gaps.
set -u
R=/tmp/sAP; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8.py tests/training/test_gpu_lora_add.py \
  tests/training/test_gpu_fp8_quant.py tests/training/test_gpu_oom.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
b32() {  # name, extra args
  local v=$1; shift
  echo "=== bench 32B $v $* $(date +%T)"; local s=$(date +%s)
  NS_STEPLOG=$R/steps-$v.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH timeout 500 python3 -m jobs.bench bench \
    --arch qwen3-32b --build-4bit --stacks ours --compute fp8 --profiles alpaca --seconds 15 --warmup 5 \
    --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAP --out $R/b32-$v "$@" > $R/bench32-$v.log 2>&1
  echo "bench 32B $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32-$v.log
}
b32 first --max-vram-gb 72
b32 warm --max-vram-gb 72
b32 half --max-vram-gb 72 --budget 1152
b32 roomy --max-vram-gb 90
echo "=== bench 32B profiled $(date +%T)"; s=$(date +%s)
NS_STEPLOG=$R/steps-prof.txt NS_TRACE=$R/trace PYTHONPATH=$PWD/results/tmp/diagAL:$PYTHONPATH timeout 500 python3 -m jobs.bench bench \
  --arch qwen3-32b --build-4bit --stacks ours --compute fp8 --profiles alpaca --seconds 8 --warmup 3 \
  --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAP --max-vram-gb 72 --out $R/b32-prof \
  --torch-profile $R/prof > $R/bench32-prof.log 2>&1
echo "bench prof exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench32-prof.log
for t in $R/trace.*.json; do echo "--- $t"; python3 results/tmp/gaps.py $t 3 | head -45; gzip -f $t; done
touch $R/DONE
