#!/usr/bin/env bash
# N GPUs of one host through the product and the bench, in one detached run (issue 44's "four GPUs ≥ 97 %"):
# (1) `python -m benchmarks scaling --gpus N` (ours and the Exxact recipe, 1 vs N cards, bench workload);
# (2) `nightshift calibrate` of the default config on one card, then on N (`[train] gpus = N`): the product's
#     scaling is calibrate on N / (N x calibrate on 1);
# (3) one night of the default config on N cards, `nightshift once --until +NIGHT_S`, RECORDS new records.
#
#   benchmarks/drivers/gpus_n.sh            start it detached (results in /tmp/gn), then return
#   benchmarks/drivers/gpus_n.sh --wait S   wait up to S seconds for it, print its logs, pack $OUT/gn.tar.xz
#
# Environment: GPUS=4 RECORDS=200000 NIGHT_S=300 ARCH=llama3.1-8b (a random-initialised model, built once);
# STEPS=scaling,calibrate,night (which of (1)-(3) to run).
set -u
R=/tmp/gn
if [ "${1:-}" = "--wait" ]; then
  end=$(( $(date +%s) + $2 ))
  while [ ! -e $R/DONE ] && [ "$(date +%s)" -lt "$end" ]; do sleep 3; done
  cat $R/driver.log; for f in $R/*.log; do echo "--- $f"; tail -6 "$f" | cut -c1-600; done
  tar --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='state' -C /tmp -cf - gn | xz -6 > "$OUT/gn.tar.xz"
  exit 0
fi
if [ "${1:-}" != "--now" ]; then
  mkdir -p $R; setsid bash "$0" --now > $R/background.log 2>&1 < /dev/null & exit 0
fi
cd "$(dirname "$0")/../.." || exit 1
exec > $R/driver.log 2>&1
GPUS=${GPUS:-4} RECORDS=${RECORDS:-200000} NIGHT_S=${NIGHT_S:-300} ARCH=${ARCH:-llama3.1-8b}
STEPS=${STEPS:-scaling,calibrate,night}
step() { case ",$STEPS," in *",$1,"*) return 0 ;; *) echo "=== $1 skipped"; return 1 ;; esac; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u +%F; cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; nproc
  echo "gpus=$GPUS records=$RECORDS night_s=$NIGHT_S arch=$ARCH"; } > $R/meta.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,power.draw,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 \
  > $R/smi.csv 2>&1 &
stamp() { echo "=== $1 $(date +%T)"; }
M=/tmp/models/$ARCH W=/tmp/gnnight
stamp build
python3 -m benchmarks.model --path "$M" --result $R/model.json --arch "$ARCH" > $R/build.log 2>&1 || echo "build failed"
if step scaling; then
stamp scaling; s=$(date +%s)
timeout 600 python3 -m benchmarks scaling --arch "$ARCH" --gpus "$GPUS" --seconds 12 --warmup 10 --max-steps 400 \
  --models-dir /tmp/models --out $R/scaling > $R/scaling.log 2>&1
echo "scaling exit $? in $(( $(date +%s) - s )) s"
fi
conf() {  # $1: the night's folder, $2: gpus
cat <<TOML
state_dir = "$1/state"
[model]
path = "$M"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$1/inbox"
settle_seconds = 0
[train]
gpus = $2
[gpu]
max_vram_gb = 40
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
TOML
}
mkdir -p $W/one/inbox $W/n/inbox
conf $W/one 1 > $W/one.toml; conf $W/n "$GPUS" > $W/n.toml
if step calibrate; then
stamp calibrate-1; s=$(date +%s)
timeout 300 python3 -m daemon --config $W/one.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate-1 \
  > $R/calibrate-1.log 2>&1
echo "calibrate on 1 exit $? in $(( $(date +%s) - s )) s"
stamp calibrate-n; s=$(date +%s)
timeout 360 python3 -m daemon --config $W/n.toml calibrate --seconds 10 --no-checkpointing-line --out $R/calibrate-n \
  > $R/calibrate-n.log 2>&1
echo "calibrate on $GPUS exit $? in $(( $(date +%s) - s )) s"
fi
if step night; then
python3 -c "
from pathlib import Path
from benchmarks.acceptance.run import records, write_jsonl
write_jsonl(Path('$W/n/inbox/night1.jsonl'), records('words', $RECORDS, 1))"
stamp night; s=$(date +%s)
timeout $(( NIGHT_S + 150 )) python3 -m daemon --config $W/n.toml once --until "$(date -d "+$NIGHT_S seconds" +%H:%M:%S)" \
  > $R/once.log 2>&1
echo "once exit $? in $(( $(date +%s) - s )) s"
python3 -m daemon --config $W/n.toml report --json > $R/report.json 2> $R/report.err
python3 -m daemon --config $W/n.toml status --json > $R/status.json 2> $R/status.err
cp $W/n/state/adapters/*/manifest.json $R/ 2>/dev/null
fi
stamp done
kill %1 2>/dev/null
touch $R/DONE
