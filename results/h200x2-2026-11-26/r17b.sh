#!/usr/bin/env bash
# issue 17 on 2 GPUs, second call: the scaling workload with 10 warm-up steps per profile (the first call's
# 3 left alpaca on 1 card compiling inside its timed window), then an 8B night on 2 cards through
# `nightshift calibrate` + `once --until`, then night 2 (60,000 more records) through `nightshift run`
# with a window opening 75 s later and prewarm_seconds = 50: wake -> first step of night 2 of an 8B.
set -u
R=/tmp/r17b; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
stamp scaling
timeout 600 python3 -m jobs.bench scaling --arch llama3.1-8b --gpus 2 --seconds 12 --warmup 10 --max-steps 400 \
  --models-dir /tmp/models --out $R/scaling > $R/scaling.log 2>&1
echo "scaling exit $?"
W=/tmp/n8; mkdir -p $W/inbox
conf() {  # $1: extra [window] lines
cat <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/models/llama3.1-8b"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
settle_seconds = 0
[train]
backend = "auto"
batching = "packed"
compute = "bf16"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
gpus = 2
[gpu]
max_vram_gb = 40
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
$1
TOML
}
conf "" > $W/n.toml
drop() { python3 -c "
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/inbox/night$1.jsonl'), records('words', 60000, $1))"; }
stamp calibrate; s=$(date +%s)
timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
drop 1
stamp night1; s=$(date +%s)
timeout 460 python3 -m daemon --config $W/n.toml once --until "$(date -d '+6 min' +%H:%M:%S)" > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
drop 2
S=$(date -d '+75 sec' +%H:%M:%S); E=$(date -d '+75 sec +4 min' +%H:%M:%S)
conf "start = \"$S\"
end = \"$E\"
prewarm_seconds = 50" > $W/run.toml
stamp "night2 window $S-$E"
python3 -m daemon --config $W/run.toml run > $R/run.log 2>&1 & P=$!
python3 - <<PY
import time
from pathlib import Path
from jobs.store.ledger import Ledger
end = time.time() + 420
while time.time() < end:
    led = Ledger(Path("$W/state/ledger.sqlite"))
    runs = [r for r in led.last_runs(5) if not str(r["night"]).startswith("manual")]
    led.close()
    if runs and runs[0]["status"] in ("succeeded", "rejected", "failed", "skipped"):
        print("night 2:", runs[0]["status"]); break
    time.sleep(2)
PY
sleep 3; kill $P; wait $P; echo "run exit $?"
python3 -m daemon --config $W/n.toml status --json > $R/status.json 2> $R/status.err
python3 -m daemon --config $W/n.toml report --json > $R/report.json 2> $R/report.err
cp -r $W/state/adapters/*/manifest.json $R/ 2>/dev/null; ls $W/state/adapters > $R/adapters.txt
stamp done
touch $R/DONE
