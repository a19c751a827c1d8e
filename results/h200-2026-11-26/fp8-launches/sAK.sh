#!/usr/bin/env bash
# issue 16: fewer launches in the FP8 LoRA Functions (LoRA weights cast once per forward and saved, x A^T saved,
# fp32 gradients straight from cuBLAS, scales of 1 not multiplied) and the LoRA-add kernel not specialised on m,
# against the code at e528565 (results/tmp/before_AK/), one machine: the GPU tests; the 8B FP8 bench cold (fresh Triton
# and inductor caches, per-step times and the caches' compile times logged: where the slow first third comes from);
# before, new, before again (warm); new under --torch-profile (launches a step); nightshift calibrate (FP8, 40 GB).
set -u
R=/tmp/sAK; mkdir -p $R/inbox $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export TRITON_CACHE_DIR=/tmp/tcAK TORCHINDUCTOR_CACHE_DIR=/tmp/icAK
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
TRITON_CACHE_DIR=/tmp/tcTests TORCHINDUCTOR_CACHE_DIR=/tmp/icTests timeout 300 python3 -m pytest -q -m gpu \
  -p no:cacheprovider tests/training/test_gpu_lora_add.py tests/training/test_gpu_fp8_quant.py \
  tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
for f in fp8_lora lora_add_kernel fp8_selftest; do cp jobs/training/$f.py $R/new/; done
bench() {  # $1 name, rest extra args
  local v=$1; shift
  echo "=== bench $v $(date +%T)"; local s=$(date +%s)
  timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAK \
    --out $R/b8-$v "$@" > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
}
# cold: the caches are empty; per-step times (sitecustomize) and each cache entry's time
date +%s.%N > $R/cold-start.txt
NS_STEPLOG=$R/steps-cold.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH TORCH_LOGS=recompiles \
  TORCH_LOGS_FORMAT="%(asctime)s %(message)s" bench new-cold
find /tmp/tcAK /tmp/icAK -type f \( -name "*.json" -o -name "*.py" \) -printf "%T@ %p\n" | sort -n > $R/cache-cold.txt
cp results/tmp/before_AK/*.py jobs/training/; bench before
cp $R/new/*.py jobs/training/; NS_STEPLOG=$R/steps-new.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH bench new
cp results/tmp/before_AK/*.py jobs/training/; NS_STEPLOG=$R/steps-before2.txt PYTHONPATH=$PWD/results/tmp/diagAK:$PYTHONPATH bench before2
cp $R/new/*.py jobs/training/
bench new-profiled --torch-profile $R/prof
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
echo "calibrate exit $? in $(( $(date +%s) - s )) s"; tail -25 $R/calibrate-8b-fp8.log
rm -rf $R/state
touch $R/DONE
