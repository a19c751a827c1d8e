#!/usr/bin/env bash
# issue 11 on one H200: a night of ~5 minutes' work planned from a night. Night 1 `once --until +4 min`
# (20,000 records, planned from a configured prior and step shape: no calibrate, to save device time),
# night 2 `once --until +7.5 min` (60,000 new records and night 1's as replay): predicted vs actual.
set -u
R=/tmp/sF; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models')))"
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
tokens_per_step = 8192
gradient_checkpointing = false
[plan]
prior_tokens_per_second = 15000
prior_overhead_seconds = 60
[gpu]
max_vram_gb = 40
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
$1
TOML
}
conf "" > $W/n.toml
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
drop 1 20000 default -
stamp night1; s=$(date +%s)
timeout 660 python3 -m daemon --config $W/n.toml once --until "$(date -d '+4 min' +%H:%M:%S)" > $R/once1.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report1.json 2> $R/report1.err
drop 2 60000 default -
ls -la $W/inbox
stamp night2; s=$(date +%s)
timeout 900 python3 -m daemon --config $W/n.toml once --until "$(date -d '+7 min +30 sec' +%H:%M:%S)" > $R/once2.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report2.json 2> $R/report2.err
python3 - > $R/throughput.json <<PY
import json, sqlite3
db = sqlite3.connect("$W/state/ledger.sqlite"); db.row_factory = sqlite3.Row
print(json.dumps([dict(r) for r in db.execute("SELECT * FROM throughput ORDER BY at")], indent=1))
PY
stamp done
touch $R/DONE
