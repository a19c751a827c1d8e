#!/usr/bin/env bash
# issue 17 on 2 GPUs: the GPU tests (a night and a calibration through the CLI), the scaling workload
# (ours and the Exxact recipe on 1 and 2 cards), an 8B night on 2 cards through calibrate + once --until.
set -u
R=/tmp/r17; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
nvidia-smi topo -m > $R/topo.txt 2>&1
stamp() { echo "=== $1 $(date +%T)"; }
stamp tests
timeout 420 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/training/test_gpu_ranks.py > $R/tests.log 2>&1
echo "tests exit $?"
stamp scaling
timeout 900 python3 -m jobs.bench scaling --arch llama3.1-8b --gpus 2 --seconds 10 --warmup 3 --max-steps 30 \
  --models-dir /tmp/models --out $R/scaling > $R/scaling.log 2>&1
echo "scaling exit $?"
stamp night8b
W=/tmp/n8; mkdir -p $W/inbox
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
gpus = 2
[gpu]
max_vram_gb = 40
TOML
s=$(date +%s)
timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
python3 -c "
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/inbox/night1.jsonl'), records('words', 60000, 1))"
python3 -m daemon --config $W/n.toml plan --json > $R/plan.json 2> $R/plan.err
s=$(date +%s)
timeout 420 python3 -m daemon --config $W/n.toml once --until "$(date -d '+5 min' +%H:%M:%S)" > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
cp $W/state/current/manifest.json $R/manifest.json 2>/dev/null
python3 -m daemon --config $W/n.toml report --json > $R/report.json 2> $R/report.err
stamp done
touch $R/DONE
