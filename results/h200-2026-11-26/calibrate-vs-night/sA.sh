#!/usr/bin/env bash
# issue 11 on one H200: calibrate-vs-night candidate (bench with/without a prompt share), then an 8B
# through `nightshift calibrate`, night 1 `once --until` (~5 min of training, 60k records) and night 2
# (60k more) through `nightshift run`, prewarmed: the wake on one GPU, the pull's workers on the host.
set -u
R=/tmp/sA; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
for ps in 0 0.5; do
  stamp "bench prompt-share $ps"; s=$(date +%s)
  timeout 400 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --seconds 10 --warmup 5 \
    --prompt-share $ps --models-dir /tmp/models --out $R/bench-ps$ps > $R/bench-ps$ps.log 2>&1
  echo "bench exit $? in $(( $(date +%s) - s )) s"
done
W=/tmp/n8; mkdir -p $W/inbox
conf() {
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
write_jsonl(Path('$W/inbox/night$1.jsonl'), records('words', $2, $1))"; }
stamp calibrate; s=$(date +%s)
timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
drop 1 60000
stamp night1; s=$(date +%s)
timeout 660 python3 -m daemon --config $W/n.toml once --until "$(date -d '+8 min' +%H:%M:%S)" > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report1.json 2> $R/report1.err
drop 2 60000
S=$(date -d '+100 sec' +%H:%M:%S); E=$(date -d '+100 sec +7 min' +%H:%M:%S)
conf "start = \"$S\"
end = \"$E\"
prewarm_seconds = 90" > $W/run.toml
stamp "night2 window $S-$E"
python3 -m daemon --config $W/run.toml run > $R/run.log 2>&1 & P=$!
python3 - <<PY
import time
from pathlib import Path
from jobs.store.ledger import Ledger
end = time.time() + 600
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
python3 -m daemon --config $W/n.toml report --json > $R/report2.json 2> $R/report2.err
cp $W/state/adapters/*/manifest.json $R/ 2>/dev/null; ls -la $W/state/adapters > $R/adapters.txt
stamp done
touch $R/DONE
