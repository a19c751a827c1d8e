#!/usr/bin/env bash
# the acceptance run with the night's process prewarmed 40 s before each window and the planner's THIN rule,
# started in its own session so that it outlives this call (the next call collects it)
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv > /tmp/acc-gpu.txt
mkdir -p /tmp/accres
NIGHTSHIFT_TRAIN__COMPUTE=bf16 setsid nohup python3 -m jobs.bench acceptance --window-minutes 2.25 --nights 3 \
  --prewarm-seconds 40 --work /tmp/acc --out /tmp/accres > /tmp/accres/acceptance.log 2>&1 < /dev/null &
echo $! > /tmp/accres/pid
sleep 5; timeout ${WAIT:-560} tail --pid=$(cat /tmp/accres/pid) -f /dev/null; tail -15 /tmp/accres/acceptance.log
