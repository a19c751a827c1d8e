#!/usr/bin/env bash
# collect the acceptance run, then lora vs qlora at one step size on the same card
set -u
pid=$(cat /tmp/accres/pid)
while kill -0 $pid 2>/dev/null; do sleep 2; done
cp /tmp/acc-gpu.txt $OUT/gpu.txt
tar czf $OUT/acceptance.tgz -C /tmp accres acc/logs
tail -5 /tmp/accres/acceptance.log
if [ "${BENCH:-1}" = 1 ]; then
python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours_lora,ours --budget 8192 --max-vram-gb 40 --seconds 10 --warmup 5 \
  --state-dir /tmp/st --out $OUT/lora-qlora.json > $OUT/lora-qlora.log 2>&1; echo "bench exit $?"
fi
