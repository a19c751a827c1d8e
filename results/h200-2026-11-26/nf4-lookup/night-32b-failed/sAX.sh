#!/usr/bin/env bash
# issue 16: Qwen3-32B through the product's own commands with the default config ([train] fp8_storage = "auto",
# compute = "fp8") under 72 GB: nightshift calibrate, then one night (`once --until`, ~5 min of training on 30k
# records) and its report: the calibrate -> night seam with the storage decided the same way on both sides.
set -u
R=/tmp/sAX; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt; lscpu >> $R/gpu.txt
head -2 $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
stamp "build 32B"; s=$(date +%s)
timeout 400 python3 -m jobs.bench.model --path /tmp/models/qwen3-32b-nf4 --arch qwen3-32b --build-4bit --result $R/model32.json > $R/model32.log 2>&1
echo "build exit $? in $(( $(date +%s) - s )) s"
W=/tmp/n32; mkdir -p $W/inbox
cat > $W/n.toml <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/models/qwen3-32b-nf4"
name = "q32"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
settle_seconds = 0
[train]
backend = "auto"
batching = "packed"
compute = "fp8"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = 72
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
TOML
stamp calibrate; s=$(date +%s)
timeout 400 python3 -m daemon --config $W/n.toml calibrate --seconds 15 --no-checkpointing-line --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"; grep '"tokens_per_second"' $R/calibrate.log | cut -c1-300
grep -o "'storage_why': '[^']*'" $R/calibrate.log | head -1
python3 -c "
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/inbox/night1.jsonl'), records('words', 30000, 1))"
stamp night1; s=$(date +%s)
timeout 700 python3 -m daemon --config $W/n.toml once --until "$(date -d '+7 min' +%H:%M:%S)" > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report1.json 2> $R/report1.err
grep -o "'storage_why': '[^']*'" $R/once.log | head -1
tail -5 $R/once.log | cut -c1-600
touch $R/DONE
