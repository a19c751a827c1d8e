#!/usr/bin/env bash
# issues 11 and 16 on one GPU: (1) `nightshift calibrate --seconds 10` with its first window after 30 s of
# warm-up, night 1 `once --until +8 min` (60,000 records, ~5 min of training planned from calibrate);
# (2) the bench's FP8 and bf16 QLoRA on both profiles with 36-s windows, their thirds' rates.
set -u
R=/tmp/sJ; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,utilization.gpu,memory.used --format=csv -l 2 > $R/smi.csv 2>&1 &
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n10; mkdir -p $W/inbox
drop() { python3 - "$@" <<PY
import random, sys
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
night, n, qs, ans = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if qs == "default":
    rows = records("words", n, night)
else:
    (q0, q1), (a0, a1), r = map(int, qs.split("-")), map(int, ans.split("-")), random.Random(night)
    w = lambda k: " ".join(f"w{r.randrange(256)}" for _ in range(k))
    rows = [{"instruction": f"{w(r.randint(q0, q1))} n{night}x{i}", "output": w(r.randint(a0, a1))} for i in range(n)]
write_jsonl(Path("$W/inbox/night%d.jsonl" % night), rows)
PY
}
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
drop 1 60000 default -
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
TOML
}
conf > $W/n.toml
stamp calibrate; s=$(date +%s)
timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
for n in 1; do
  [ $n = 2 ] && drop 2 60000 default -
  stamp night$n; s=$(date +%s)
  timeout 660 python3 -m daemon --config $W/n.toml once --until "$(date -d '+8 min' +%H:%M:%S)" > $R/once$n.log 2>&1
  echo "once exit $? in $(( $(date +%s) - s )) s"
  python3 -m daemon --config $W/n.toml report --json > $R/report$n.json 2> $R/report$n.err
done
python3 -m daemon --config $W/n.toml status --json > $R/status.json 2> $R/status.err
python3 - > $R/throughput.json <<PY
import json, sqlite3
db = sqlite3.connect("$W/state/ledger.sqlite"); db.row_factory = sqlite3.Row
print(json.dumps([dict(r) for r in db.execute("SELECT * FROM throughput ORDER BY at")], indent=1))
PY
cp $W/state/adapters/*/manifest.json $R/ 2>/dev/null; ls -la $W/state/adapters > $R/adapters.txt
stamp bench; s=$(date +%s)
timeout 600 python3 -m jobs.bench bench --arch llama3.1-8b --stacks ours --compute fp8,bf16 --max-vram-gb 40 \
  --seconds 36 --max-steps 300 --warmup 5 --data-tokens 1500000 --fp8-learnable-steps 0 --models-dir /tmp/models \
  --state-dir /tmp/stJ --out $R/bench > $R/bench.log 2>&1
echo "bench exit $? in $(( $(date +%s) - s )) s"
stamp done
touch $R/DONE
