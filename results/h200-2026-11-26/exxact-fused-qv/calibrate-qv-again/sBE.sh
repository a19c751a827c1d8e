#!/usr/bin/env bash
# issue 13: through the product: nightshift calibrate of Llama-3.1-8B, method lora, the Exxact study's adapter
# (r=16, alpha 32 on q and v), compute fp8, 40 GB; then the FP8 GPU tests (the mended q,v test).
set -u
R=/tmp/sBE; mkdir -p $R/inbox; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== build $(date +%T)"; s=$(date +%s)
python3 -c "
from pathlib import Path
from jobs.bench.settings import BenchSettings
from jobs.bench.model import resolve_model
resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models')))" > $R/build.log 2>&1
echo "build exit $? in $(( $(date +%s) - s )) s"; tail -2 $R/build.log
echo "=== calibrate $(date +%T)"; s=$(date +%s)
timeout 330 python3 -m daemon --config results/tmp/calBE.toml calibrate --seconds 15 --no-checkpointing-line \
  --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"; tail -30 $R/calibrate.log
touch $R/DONE
