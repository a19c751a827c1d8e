#!/usr/bin/env bash
# wait for r17.sh up to $1 seconds, then return what it has written so far
R=/tmp/r17; end=$(( $(date +%s) + $1 ))
while [ ! -e $R/DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cat $R/driver.log; tail -3 $R/scaling.log 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv
tar czf $OUT/r17.tgz -C /tmp r17 --exclude='*.safetensors' 2>/dev/null
