#!/usr/bin/env bash
# wait for sBA.sh up to $1 seconds, then return what it has written so far
R=/tmp/sBA; end=$(( $(date +%s) + $1 ))
while [ ! -e $R/DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cat $R/driver.log; for f in $R/*.log; do echo "--- $f"; tail -5 $f; done; nvidia-smi --query-gpu=memory.used --format=csv
tar czf $OUT/sBA.tgz -C /tmp sBA --exclude='*.safetensors' 2>/dev/null
