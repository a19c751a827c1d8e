#!/usr/bin/env bash
# issue 11 on one GPU: (1) import unsloth whole vs without the TRL trainer rewrite (fresh processes,
# alternated); (2) the calibrate gap: hint.py's variants, each in its own process and compile cache.
set -u
R=/tmp/sH; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,utilization.gpu,memory.used --format=csv -l 2 > $R/smi.csv 2>&1 &
stamp() { echo "=== $1 $(date +%T)"; }
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.settings import BenchSettings
from jobs.bench.model import resolve_model
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
for k in 1 2; do
  for how in whole skip; do
    stamp "import $how $k"
    python3 -c "
import time
from jobs.training.unsloth_backend import setup_caches
setup_caches('/tmp/ic')
t = time.perf_counter()
if '$how' == 'whole':
    import unsloth
    s = None
else:
    from jobs.training.unsloth_import import import_unsloth
    s = import_unsloth()
print('import $how $k', round(time.perf_counter() - t, 2), 'skipped', s)" >> $R/imports.log 2>&1
  done
done
python3 -X importtime -c "
from jobs.training.unsloth_backend import setup_caches
setup_caches('/tmp/ic')
from jobs.training.unsloth_import import import_unsloth
import_unsloth()" 2> $R/importtime-skip.txt
for v in direct calib probe8k calib-reset direct; do
  stamp "hint $v"
  timeout 400 python3 results/tmp/hint.py $v $R/hint-$v-$(date +%s).json > $R/hint-$v.log 2>&1
  echo "exit $?"
done
stamp done
