#!/usr/bin/env bash
# Issue 44 item 7 on one GPU, in one device call: the same task trained through bf16, NF4 and FP8 nights of the
# product (`python -m benchmarks parity`, benchmarks/parity.py), scored by exact match (benchmarks/greedy.py).
#
#   benchmarks/drivers/parity_gpu.sh [ARCH] [SECONDS]      (default llama3.1-8b, 250: the 8B's three paths side by
#                                                           side, four nights each, take ~200 s on an H200)
#
# SECONDS bounds the benchmark (the 8B's build included): no night starts that would end after it; the
# command is killed 70 s later whatever it is doing (parity.json is written after every night and score).
# Writes $OUT/parity-ARCH.tar.xz (weights left out): meta.txt (card, driver, torch, commit), parity.log, smi.csv,
# parity/parity.json (every night's row, loss curve and score; the tables) and the nights' manifests.
set -u
arch=${1:-llama3.1-8b}
seconds=${2:-250}
R=/tmp/parity-$arch
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/card, memory, driver: /'
  python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)'
  pip list 2>/dev/null | grep -i -E "^(unsloth|bitsandbytes|triton) "
  echo "command: python3 -m benchmarks parity --arch $arch --budget-seconds $seconds --models-dir /tmp/models --out $R/parity"
} > "$R/meta.txt" 2>&1
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,utilization.gpu,memory.used --format=csv -l 2 > "$R/smi.csv" 2>&1 &
smi=$!
s=$(date +%s)
timeout --signal=TERM --kill-after=10 $(( seconds + 70 )) python3 -m benchmarks parity --arch "$arch" \
  --budget-seconds "$seconds" --models-dir /tmp/models --out "$R/parity" > "$R/parity.log" 2>&1
echo "parity exit $? in $(( $(date +%s) - s )) s" >> "$R/meta.txt"
kill $smi 2>/dev/null
for m in "$R"/parity/work/*/state/adapters/*/manifest.json; do
  [ -e "$m" ] && cp "$m" "$R/$(echo "$m" | sed "s|$R/parity/work/||; s|/state/adapters/|-|; s|/manifest.json||").manifest.json"
done
grep -v -E "Loading weights|Writing model shards" "$R/parity.log" | tail -40
tar --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='work' -C /tmp -cf - "parity-$arch" \
  | xz -6 > "${OUT:-/tmp}/parity-$arch.tar.xz"
