#!/usr/bin/env bash
# the acceptance run again after the checkpoint-accounting change (one call; prewarm 35 s)
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -l 1 > /tmp/apps.csv 2>&1 &
NIGHTSHIFT_TRAIN__COMPUTE=bf16 timeout 420 python3 -m jobs.bench acceptance --window-minutes 2.25 --nights 3 \
  --prewarm-seconds 35 --work /tmp/acc --out /tmp/accres > $OUT/acceptance.log 2>&1
echo "acceptance exit $?"
cp /tmp/apps.csv /tmp/accres/
tar czf $OUT/acceptance.tgz -C /tmp accres acc/logs
