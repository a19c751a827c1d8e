#!/usr/bin/env bash
# one night of about 4-5 minutes of training through `nightshift calibrate` + `nightshift run` (issue 11's budget goal)
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
NIGHTSHIFT_TRAIN__COMPUTE=bf16 timeout 540 python3 -m jobs.bench acceptance --window-minutes 6 --nights 1 --kill-night 0 \
  --fill 0.95 --prewarm-seconds 35 --work /tmp/acc --out /tmp/accres > $OUT/acceptance.log 2>&1
echo "acceptance exit $?"
tar czf $OUT/acceptance.tgz -C /tmp accres acc/logs
