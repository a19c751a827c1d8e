#!/usr/bin/env bash
# issue 11: the wake of a child started inside its window (`once`), night 2 of the 8B with 60,000 new records,
# after this stop's cuts (early pull workers, every model scored after training, token ids read while the
# model loads, the cache read without parsing records); then whether a new adapter scores as the base under
# Unsloth's kernels (bf16 and FP8).
set -u
R=/tmp/sK; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,utilization.gpu,memory.used --format=csv -l 2 > $R/smi.csv 2>&1 &
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n11; mkdir -p $W/inbox
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
for n in 1 2; do
  drop $n 60000
  stamp night$n; s=$(date +%s)
  until=$([ $n = 1 ] && echo '+150 sec' || echo '+210 sec')
  timeout 400 python3 -m daemon --config $W/n.toml once --until "$(date -d "$until" +%H:%M:%S)" > $R/once$n.log 2>&1
  echo "once exit $? in $(( $(date +%s) - s )) s"
  python3 -m daemon --config $W/n.toml report --json > $R/report$n.json 2> $R/report$n.err
done
python3 -m daemon --config $W/n.toml status --json > $R/status.json 2> $R/status.err
cp $W/state/adapters/*/manifest.json $R/ 2>/dev/null; ls -la $W/state/adapters > $R/adapters.txt
stamp newadapter; s=$(date +%s)
timeout 240 python3 results/tmp/newadapter.py /tmp/models/llama3.1-8b bf16 fp8 > $R/newadapter.log 2>&1
echo "newadapter exit $? in $(( $(date +%s) - s )) s"
stamp done; touch $R/DONE
