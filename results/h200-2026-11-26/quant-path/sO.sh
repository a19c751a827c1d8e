#!/usr/bin/env bash
# issues 11 and 16's gap: the 8B quantised in the process (as calibrate and a first night load it) against the NF4
# copy from the cache (as later nights do): layout, first step, 20 steps; three fresh processes on one cache dir.
set -u
R=/tmp/sO; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
for label in quantised-here cached cached-again; do
  timeout 60 python3 results/tmp/quantpath.py /tmp/models/llama3.1-8b /tmp/qp $label > $R/$label.log 2>&1
  echo "$label exit $?"; tail -1 $R/$label.log
done
touch $R/DONE
