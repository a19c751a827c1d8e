#!/usr/bin/env bash
# issue 11: the restarted child's wake with the inbox checked while the child imports (jobs/data/prefetch.py), in
# this image's environment as it is (no bytecode for ~2,400 of the night's modules, none written): nights 1-3 of
# the 8B (60,000 new records each) through `once`, as sP ran them; the workers now one thread each, niced (sS: the
# imports took 25.7-30.9 s beside 8 workers checking with a thread per CPU each).
set -u
R=/tmp/sT; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n18; mkdir -p $W/inbox
drop() { python3 - "$@" <<PY
import sys
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
night, n = int(sys.argv[1]), int(sys.argv[2])
write_jsonl(Path("$W/inbox/night%d.jsonl" % night), records("words", n, night))
PY
}
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
cat > $W/n.toml <<TOML
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
[gpu]
max_vram_gb = 40
[plan]
prior_tokens_per_second = 15000
prior_overhead_seconds = 60
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
TOML
for k in 1 2; do  # this machine's imports alone (no workers beside them), as the child makes them
  python3 -c "
import time
t = time.time()
from pathlib import Path
from jobs.training.unsloth_backend import setup_caches
setup_caches(Path('$W/alone/models'))
from jobs.training.unsloth_import import import_unsloth
import_unsloth()
from jobs.night.run import run_night
print('imports alone', round(time.time() - t, 1))" 2>&1 | tail -1
done
for n in 1 2 3; do
  drop $n 60000
  stamp night$n; s=$(date +%s)
  until=$([ $n = 1 ] && echo '+150 sec' || echo '+170 sec')
  timeout 300 python3 -m daemon --config $W/n.toml once --until "$(date -d "$until" +%H:%M:%S)" > $R/once$n.log 2>&1
  echo "once exit $? in $(( $(date +%s) - s )) s"
  python3 -m daemon --config $W/n.toml report --json > $R/report$n.json 2> $R/report$n.err
  grep -h '"imported"\|pull_checking_ahead\|file_ingested\|"first_step"\|"model_loaded"' $R/once$n.log | cut -c1-400
done
python3 -c "
import json
for n in json.load(open('$R/report3.json'))['nights']:
    print('wake', round(n['first_step_seconds'], 1), 'tokens', n['trained_tokens'], '/', n['planned_tokens'])"
stamp done; touch $R/DONE
