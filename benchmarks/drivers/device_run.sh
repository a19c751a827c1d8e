#!/usr/bin/env bash
# One driver for every measurement in benchmarks/RESULTS.md: it runs product commands in a folder of their own
# and records what a row of the table needs (card, driver, torch, commit, the exact command, its exit status and
# seconds), so a new row is a copy of `meta.txt` and a figure from the command's own log.
#
#   benchmarks/drivers/device_run.sh [options] OUT_DIR -- COMMAND [ARG...]
#   benchmarks/drivers/device_run.sh --wait SECONDS OUT_DIR
#
# Each call runs one command; call it again with the same OUT_DIR for the next one (logs are numbered).
# Options (before OUT_DIR):
#   --timeout S        stop the command after S seconds (default 540: a device call has 600)
#   --config TEMPLATE  render a TOML template (${OUT}, ${MODEL}, ${INBOX} and any exported variable) into
#                      OUT_DIR/nightshift.toml and export NIGHTSHIFT_CONFIG to it for the command
#   --smi              sample nvidia-smi (power, SM clock, memory) every 2 s into OUT_DIR/smi.csv meanwhile
#   --background       start under setsid and return at once; collect it with --wait in a later call
#   --tar FILE         when done, pack OUT_DIR (weights left out) into FILE (e.g. $OUT/name.tar.xz)
# In COMMAND, {OUT} stands for OUT_DIR (e.g. `nightshift calibrate --out {OUT}/calibrate`).
#
# Examples:
#   benchmarks/drivers/device_run.sh --config benchmarks/drivers/night.toml /tmp/r8 -- nightshift calibrate --seconds 20
#   benchmarks/drivers/device_run.sh --config benchmarks/drivers/night.toml /tmp/r8 -- nightshift once --until "$(date -d +8min +%T)"
#   benchmarks/drivers/device_run.sh --tar "$OUT/r8.tar.xz" /tmp/r8 -- python -m benchmarks bench --arch llama3.1-8b \
#       --stacks ours --compute fp8,bf16 --max-vram-gb 40 --seconds 15 --warmup 5 --out {OUT}/bench
set -uo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

timeout_s=540 template="" smi=0 background=0 tarball="" wait_s=""
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_s=$2; shift 2 ;;
    --config) template=$2; shift 2 ;;
    --smi) smi=1; shift ;;
    --background) background=1; shift ;;
    --tar) tarball=$2; shift 2 ;;
    --wait) wait_s=$2; shift 2 ;;
    -h|--help) usage ;;
    --) usage ;;
    -*) echo "device_run.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
R=$1; shift
repo=$(cd "$(dirname "$0")/../.." && pwd)

pack() {
  [ -n "$tarball" ] || return 0
  tar --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C "$(dirname "$R")" -cf - "$(basename "$R")" \
    | xz -9 > "$tarball"
}

if [ -n "$wait_s" ]; then
  # Collect a --background run: wait for its DONE (at most SECONDS), show what it wrote, pack it.
  end=$(( $(date +%s) + wait_s ))
  while [ ! -e "$R/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  [ -e "$R/DONE" ] || echo "device_run.sh: $R not done after $wait_s s (what it has so far follows)" >&2
  cat "$R/driver.log" 2>/dev/null
  for f in "$R"/step-*.log; do [ -e "$f" ] && { echo "--- $f"; tail -5 "$f"; }; done
  pack
  [ -e "$R/DONE" ]; exit $?
fi

[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || { echo "device_run.sh: no command after OUT_DIR --" >&2; usage; }

if [ "$background" = 1 ]; then
  args=(--timeout "$timeout_s")
  [ -n "$template" ] && args+=(--config "$template")
  [ "$smi" = 1 ] && args+=(--smi)
  mkdir -p "$R"; rm -f "$R/DONE"
  setsid "$0" "${args[@]}" "$R" -- "$@" > "$R/background.log" 2>&1 < /dev/null &
  echo "started in the background: collect with $0 --wait SECONDS $R"
  exit 0
fi

mkdir -p "$R"; rm -f "$R/DONE"
cd "$repo" || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export OUT_DIR="$R"

# What a row of RESULTS.md needs, once per folder.
if [ ! -e "$R/meta.txt" ]; then
  {
    echo "date: $(date -u +%F)"
    echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet 2>/dev/null || echo ' (dirty)')"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/card, memory, driver: /'
    else
      echo "card: none (CPU: $(nproc) cores)"
    fi
    echo "cpus: $(nproc)"
    python3 -c 'import sys, torch; print("torch:", torch.__version__, "| python:", sys.version.split()[0])' 2>/dev/null \
      || echo "torch: not importable"
  } > "$R/meta.txt"
fi

if [ -n "$template" ]; then
  export OUT="$R" MODEL="${MODEL:-$R/model}" INBOX="${INBOX:-$R/inbox}"
  mkdir -p "$INBOX"
  python3 -c 'import os, string, sys; print(string.Template(open(sys.argv[1]).read()).substitute(os.environ), end="")' \
    "$template" > "$R/nightshift.toml" || { echo "device_run.sh: cannot render $template" >&2; exit 2; }
  export NIGHTSHIFT_CONFIG="$R/nightshift.toml"
fi

smi_pid=""
if [ "$smi" = 1 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu,utilization.gpu,memory.used \
    --format=csv -l 2 >> "$R/smi.csv" 2>&1 &
  smi_pid=$!
fi

cmd=()
for a in "$@"; do cmd+=("${a//\{OUT\}/$R}"); done
n=$(( $(find "$R" -maxdepth 1 -name 'step-*.log' | wc -l) + 1 ))
log=$(printf '%s/step-%02d.log' "$R" "$n")
start=$(date +%s)
echo "=== step $n $(date -u +%T): ${cmd[*]}" >> "$R/driver.log"
timeout --signal=TERM --kill-after=30 "$timeout_s" "${cmd[@]}" > "$log" 2>&1
rc=$?
echo "step $n exit $rc in $(( $(date +%s) - start )) s" >> "$R/driver.log"
[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
touch "$R/DONE"
pack
tail -3 "$log"
exit $rc
