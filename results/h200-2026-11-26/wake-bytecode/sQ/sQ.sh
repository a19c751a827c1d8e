#!/usr/bin/env bash
# issue 11: the restarted child's wake with the bytecode a pip install leaves (the device's install line skips it,
# and this environment writes none: sP's imports compiled ~3,200 modules from source, 7.8 s): compileall over the
# wheels and the repo, then nights 1-3 of the 8B (60,000 new records each) through `once`; the imports under
# cProfile again; which key torch 2.11 files dynamo's compile seconds under.
set -u
R=/tmp/sQ; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n15; mkdir -p $W/inbox
drop() { python3 - "$@" <<PY
import sys
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
night, n = int(sys.argv[1]), int(sys.argv[2])
write_jsonl(Path("$W/inbox/night%d.jsonl" % night), records("words", n, night))
PY
}
{ env | grep -i '^python'; python3 -c "import sys; print('dont_write_bytecode', sys.dont_write_bytecode, 'prefix', sys.pycache_prefix)"; } > $R/env.txt 2>&1
stamp compileall; s=$(date +%s)
python3 -m compileall -q -j 0 /tmp/site jobs daemon > $R/compileall.log 2>&1; echo "compileall exit $? in $(( $(date +%s) - s )) s"
find /tmp/site -name '*.pyc' | wc -l
stamp metrics
python3 -c "
import torch, torch._dynamo.utils as u
f = torch.compile(lambda x: x * 2 + 1)
f(torch.ones(3, device='cuda'))
print(torch.__version__, sorted((k, round(sum(v), 2)) for k, v in u.compilation_time_metrics.items() if sum(v) > 0.5))
" > $R/metrics.log 2>&1
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
for n in 1 2 3; do
  if [ $n = 2 ]; then
    stamp importprof
    timeout 90 python3 results/tmp/importprof.py $W/state/models $R/import.prof > $R/importprof.log 2>&1; echo "importprof exit $?"
  fi
  drop $n 60000
  stamp night$n; s=$(date +%s)
  until=$([ $n = 1 ] && echo '+150 sec' || echo '+170 sec')
  TORCH_LOGS=recompiles timeout 300 python3 -m daemon --config $W/n.toml once --until "$(date -d "$until" +%H:%M:%S)" > $R/once$n.log 2>&1
  echo "once exit $? in $(( $(date +%s) - s )) s"
  python3 -m daemon --config $W/n.toml report --json > $R/report$n.json 2> $R/report$n.err
  grep -h '"imported"\|file_ingested\|"first_step"\|"model_loaded"' $R/once$n.log | cut -c1-400
done
stamp done; touch $R/DONE
