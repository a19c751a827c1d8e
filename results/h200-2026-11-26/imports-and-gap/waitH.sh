#!/usr/bin/env bash
# wait up to $1 s for sH.sh, then copy what it wrote to $OUT
end=$(( $(date +%s) + ${1:-550} ))
while [ $(date +%s) -lt $end ] && ! grep -q "=== done" /tmp/sH/driver.log 2>/dev/null; do sleep 5; done
cp -r /tmp/sH/. $OUT/ 2>/dev/null; tail -5 /tmp/sH/driver.log
