#!/usr/bin/env bash
# issue 13: the Exxact workload, FP8, after a q,v adapter's unfused layers run the fused FP8 Functions (new) against
# the code at 6603374 (old), alternated (new, old, new, old) on one machine; then new under an 80 GB cap. GPU tests first.
set -u
R=/tmp/sBC; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== gpu tests $(date +%T)"; s=$(date +%s)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_gpu_fp8.py > $R/tests.log 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"; tail -3 $R/tests.log
rm -rf /tmp/old && mkdir /tmp/old && cp -r jobs daemon config pyproject.toml /tmp/old/ && cp -r results/tmp/old_BA/jobs /tmp/old/
W="python3 -m jobs.bench workloads --quick --workloads exxact --fp8-learnable-steps 0 --warmup 8 --max-steps 60 --seconds 15 --data-tokens 1000000 --models-dir /tmp/models --compute fp8"
for i in 1 2; do
  echo "=== new $i $(date +%T)"; s=$(date +%s)
  timeout 200 $W --deadline 190 --state-dir /tmp/stN$i --out $R/new$i > $R/new$i.log 2>&1
  echo "new$i exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/new$i/workloads.md 2>/dev/null
  echo "=== old $i $(date +%T)"; s=$(date +%s)
  (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout 200 $W --deadline 190 --state-dir /tmp/stO$i --out $R/old$i > $R/old$i.log 2>&1)
  echo "old$i exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/old$i/workloads.md 2>/dev/null
done
echo "=== new, 80 GB $(date +%T)"; s=$(date +%s)
timeout 200 $W --max-vram-gb 80 --deadline 190 --state-dir /tmp/stB --out $R/new80 > $R/new80.log 2>&1
echo "new80 exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/new80/workloads.md 2>/dev/null
touch $R/DONE
