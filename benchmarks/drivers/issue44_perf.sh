#!/usr/bin/env bash
# issue 44 item 1 on one H200, one call: `nightshift calibrate` of the default config (compute auto -> FP8,
# max_vram_gb = 40) on this tree, then the FP8 step's before/after in one process (benchmarks/drivers/fp8_step_ab.py:
# calibrate's own windows with the host-side changes switched off and on, and 3 profiled steps), then the GPU tests.
# Everything lands in $1 (default /tmp/r2); `DEADLINE` (epoch seconds) bounds the last test run.
#   benchmarks/drivers/issue44_perf.sh /tmp/r2
set -u
R=${1:-/tmp/r2}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 420 ))}
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
stamp() { echo "=== $1 $(date +%T) ($(( DEADLINE - $(date +%s) )) s left)"; }
{ date -u +%FT%T; cat COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  nproc; } > "$R/meta.txt" 2>&1
W=/tmp/w44perf-night; mkdir -p $W/inbox
stamp build
python3 -c "
from pathlib import Path
from benchmarks.model import resolve_model
from benchmarks.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > "$R/build.log" 2>&1
python3 -c "
from pathlib import Path
from benchmarks.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/inbox/night1.jsonl'), records('words', 4000, 1))"
cat > $W/n.toml <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/models/llama3.1-8b"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
settle_seconds = 0
[gpu]
max_vram_gb = 40
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
TOML
stamp calibrate; s=$(date +%s)
timeout 220 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out "$R/calibrate" \
  > "$R/calibrate.log" 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
stamp ab; s=$(date +%s)
timeout 180 python3 -m benchmarks.drivers.fp8_step_ab "$R/ab" --rounds 1 --seconds 6 --profile-variants on \
  > "$R/ab.log" 2>&1
echo "ab exit $? in $(( $(date +%s) - s )) s"
stamp tests; s=$(date +%s)
timeout 100 python3 -m pytest -q -n0 -m gpu tests/training/test_gpu_step_host.py tests/training/test_gpu_fp8_quant.py \
  > "$R/tests.log" 2>&1
echo "tests exit $? in $(( $(date +%s) - s )) s"
left=$(( DEADLINE - $(date +%s) - 15 ))
if [ "$left" -gt 30 ]; then
  stamp tests-fp8; s=$(date +%s)
  timeout "$left" python3 -m pytest -q -n0 -m gpu tests/training/test_gpu_fp8.py > "$R/tests_fp8.log" 2>&1
  echo "tests-fp8 exit $? in $(( $(date +%s) - s )) s"
fi
stamp done
