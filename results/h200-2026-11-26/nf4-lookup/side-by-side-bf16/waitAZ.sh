#!/usr/bin/env bash
# wait for sAZ.sh up to $1 seconds, then return what it has written so far
R=/tmp/sAZ; end=$(( $(date +%s) + $1 ))
while [ ! -e $R/DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cat $R/driver.log; for f in $R/*.log; do echo "--- $f"; tail -5 $f; done; nvidia-smi --query-gpu=memory.used --format=csv
tar czf $OUT/sAZ.tgz -C /tmp sAZ --exclude='*.safetensors' 2>/dev/null
