#!/usr/bin/env bash
# issue 16: the LoRA adds as a Triton kernel (large outputs) and the quantisation's block fitted to its inputs, against
# the code before them, one machine, one call: the GPU tests, the 8B bench (FP8, both profiles) new / old / new, then
# the product's `nightshift calibrate --seconds 20` with compute = "fp8" under max_vram_gb = 40.
set -u
R=/tmp/sAF; mkdir -p $R/inbox $R/new; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_lora_add.py \
  tests/training/test_gpu_fp8_quant.py tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/tests.log
for f in fp8_lora fp8 fp8_quant_kernel; do cp jobs/training/$f.py $R/new/; done
for v in new before new2; do
  if [ $v = before ]; then cp results/tmp/before_AF/*.py jobs/training/; else cp $R/new/*.py jobs/training/; fi
  echo "=== bench $v $(date +%T)"; s=$(date +%s)
  timeout 300 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8 --max-vram-gb 40 \
    --seconds 15 --warmup 5 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stAF \
    --out $R/b8-$v > $R/bench8-$v.log 2>&1
  echo "bench $v exit $? in $(( $(date +%s) - s )) s"; grep "FP8 base |" $R/bench8-$v.log
done
cp $R/new/*.py jobs/training/
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
