#!/usr/bin/env bash
# issue 11 on one H200: does calibrate read low because its window is short? `nightshift calibrate
# --seconds 10` (cold caches, as every calibrate so far), then `--seconds 60` on the same state directory.
set -u
R=/tmp/sG; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models')))" > /dev/null 2>&1
W=/tmp/n8; mkdir -p $W/inbox
cat > $W/n.toml <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/models/llama3.1-8b"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
[train]
backend = "auto"
batching = "packed"
compute = "bf16"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = 40
TOML
for sec in 10 60; do
  stamp "calibrate $sec"; s=$(date +%s)
  timeout 400 python3 -m daemon --config $W/n.toml calibrate --seconds $sec --no-checkpointing-line --out $R/calibrate-$sec > $R/calibrate-$sec.log 2>&1
  echo "calibrate exit $? in $(( $(date +%s) - s )) s"
done
stamp done
touch $R/DONE
