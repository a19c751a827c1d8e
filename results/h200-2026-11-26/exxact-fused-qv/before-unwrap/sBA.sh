#!/usr/bin/env bash
# issue 13: the Exxact workload after the q,v adapter's layers run the fused FP8 Functions. GPU tests of FP8 first;
# then the workload (recipe, ours bf16, ours FP8) with the new code; ours FP8 under a 80 GB cap; the code at HEAD.
set -u
R=/tmp/sBA; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/tests.log
W="python3 -m jobs.bench workloads --quick --workloads exxact --fp8-learnable-steps 0 --warmup 8 --max-steps 60 --seconds 15 --data-tokens 1000000 --models-dir /tmp/models"
echo "=== new $(date +%T)"; s=$(date +%s)
timeout 400 $W --compute bf16,fp8 --deadline 380 --state-dir /tmp/stA --out $R/new > $R/new.log 2>&1
echo "new exit $? in $(( $(date +%s) - s )) s"; tail -5 $R/new/workloads.md 2>/dev/null
echo "=== new, 80 GB $(date +%T)"; s=$(date +%s)
timeout 300 $W --compute fp8 --max-vram-gb 80 --deadline 280 --state-dir /tmp/stB --out $R/new80 > $R/new80.log 2>&1
echo "new80 exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/new80/workloads.md 2>/dev/null
echo "=== HEAD 6603374 $(date +%T)"; s=$(date +%s)
rm -rf /tmp/old && mkdir /tmp/old && cp -r jobs daemon config pyproject.toml /tmp/old/ 2>/dev/null; cp -r results/tmp/old_BA/jobs /tmp/old/
(cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout 300 $W --compute fp8 --deadline 280 --state-dir /tmp/stC --out $R/old > $R/old.log 2>&1)
echo "old exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/old/workloads.md 2>/dev/null
touch $R/DONE
