#!/usr/bin/env bash
# issue 11: the restarted child's wake with the bytecode a pip install leaves, everywhere: this image's venv holds
# ~2,400 of the night's modules without it (uv installs none) and PYTHONDONTWRITEBYTECODE=1 keeps every process from
# writing it (sQ: 6.5 s of the imports compiling source). compileall over the venv, the wheels and the repo, then
# nights 1-3 of the 8B (60,000 new records each) through `once`; the imports under cProfile again.
set -u
R=/tmp/sR; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n16; mkdir -p $W/inbox
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
PURE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); echo "purelib $PURE $(find $PURE -name '*.pyc' | wc -l) pyc before"
timeout 240 python3 -m compileall -q -j 0 $(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") /tmp/site jobs daemon > $R/compileall.log 2>&1; echo "compileall exit $? in $(( $(date +%s) - s )) s"
echo "pyc after: $(find $PURE -name '*.pyc' | wc -l) in purelib, $(find /tmp/site -name '*.pyc' | wc -l) in /tmp/site"
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
