#!/usr/bin/env bash
# issue 44 on one GPU, one machine, one run (started detached; collect with `issue44.sh --wait SECONDS`):
# (1) `python -m benchmarks bench` of the 8B: ours FP8 (measured through calibrate's own time_profiles now) beside
#     TRL + Liger Kernel, both profiles, with a torch.profiler capture of ours' steps;
# (2) `nightshift calibrate` of the default config (compute auto -> FP8 on this card, max_vram_gb = 40);
# (3) one night of that config, `nightshift once --until +210 s`, 60,000 new records; its report.
set -u
R=/tmp/i44
if [ "${1:-}" = "--wait" ]; then
  end=$(( $(date +%s) + $2 ))
  while [ ! -e $R/DONE ] && [ "$(date +%s)" -lt "$end" ]; do sleep 3; done
  cat $R/driver.log; for f in $R/*.log; do echo "--- $f"; tail -4 "$f" | cut -c1-600; done
  tar --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='state' -C /tmp -cf - i44 | xz -6 > "$OUT/i44.tar.xz"
  exit 0
fi
if [ "${1:-}" != "--now" ]; then
  mkdir -p $R; setsid bash "$0" --now > $R/background.log 2>&1 < /dev/null & exit 0
fi
cd "$(dirname "$0")/../.." || exit 1
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
{ date -u +%F; cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  nproc; pip list 2>/dev/null | grep -i -E "^(liger|trl|transformers|peft|bitsandbytes|unsloth) "; } > $R/meta.txt 2>&1
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 > $R/smi.csv 2>&1 &
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/w44night; mkdir -p $W/inbox
stamp build
python3 -c "
from pathlib import Path
from benchmarks.model import resolve_model
from benchmarks.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
python3 -c "
from pathlib import Path
from benchmarks.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/inbox/night1.jsonl'), records('words', 60000, 1))"
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
stamp bench; s=$(date +%s)
timeout 330 python3 -m benchmarks bench --arch llama3.1-8b --stacks ours,trl_liger --compute fp8 --max-vram-gb 40 \
  --seconds 10 --warmup 3 --max-steps 30 --fp8-learnable-steps 0 --models-dir /tmp/models --state-dir /tmp/stb \
  --torch-profile $R/prof --out $R/bench > $R/bench.log 2>&1
echo "bench exit $? in $(( $(date +%s) - s )) s"
stamp calibrate; s=$(date +%s)
timeout 300 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate \
  > $R/calibrate.log 2>&1
echo "calibrate exit $? in $(( $(date +%s) - s )) s"
stamp night; s=$(date +%s)
timeout 330 python3 -m daemon --config $W/n.toml once --until "$(date -d '+210 seconds' +%H:%M:%S)" > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report.json 2> $R/report.err
python3 -m daemon --config $W/n.toml adapters show current > $R/adapters.txt 2>&1
cp $W/state/adapters/*/manifest.json $R/ 2>/dev/null
stamp done
kill %1 2>/dev/null
touch $R/DONE
