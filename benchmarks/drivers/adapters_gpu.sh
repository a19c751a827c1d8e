#!/usr/bin/env bash
# Several adapters in one night (issue 43), through the product's own commands: `nightshift calibrate` once
# (the shared throughput key of the base), then a night of ONE adapter on N tokens and a night of FOUR adapters
# on N/4 tokens each: the very same records, dealt round-robin to four inboxes, so the totals are equal.
#
#   benchmarks/drivers/adapters_gpu.sh [--cpu] OUT_DIR
#
# Writes OUT_DIR/result.json and OUT_DIR/result.md: each night's wall seconds (the `once` command, child start to
# exit), trained tokens, its summary (per adapter for the four), the plan error (actual / predicted train seconds
# - 1, per adapter and summed) and the ratio four / one; logs in OUT_DIR/*.log, meta.txt as device_run.sh writes.
# --cpu: the tiny demo model and the hf backend on the CPU (the script's logic, tested in
# tests/night/test_adapters_driver.py); calibrate is skipped there (it measures the GPU path only).
#
# Environment (defaults for the GPU):
#   ARCH=llama3.1-8b     the random-initialised architecture (benchmarks/model.py builds it under MODELS_DIR)
#   MODELS_DIR=/tmp/models
#   RECORDS=8000         records in all (~75 tokens each on a random model's word tokenizer: ~600k tokens)
#   WINDOW_MIN=8         minutes each night's window lasts (`once --until`): long enough for all of N
#   CAL_SECONDS=15       `calibrate --seconds`
#   BACKEND=auto METHOD=qlora MAX_VRAM_GB=40 BATCHING=packed
#   PARALLEL=0           1: the two nights at the same time, one (CUDA_VISIBLE_DEVICES=0) and four
#                        (CUDA_VISIBLE_DEVICES=1), after calibrate on GPU 0: needs 2 GPUs (refused otherwise;
#                        with --cpu both run on the CPU). Each night's wall seconds are its own, as sequentially.
# On the device (see COMMON.md): install the wheels and export PYTHONPATH first. Building the 8B, calibrating and the
# two nights can take more than one call's 10 minutes: start it in the background and collect it in a later call,
#   benchmarks/drivers/device_run.sh --background --timeout 1700 /tmp/ad -- benchmarks/drivers/adapters_gpu.sh /tmp/ad/run
#   benchmarks/drivers/device_run.sh --wait 540 --tar "$OUT/adapters.tar.xz" /tmp/ad    # (again until DONE)
# A second run in the same OUT_DIR keeps the model and the calibration (the nights start from fresh state).
set -uo pipefail

cpu=0
[ "${1:-}" = "--cpu" ] && { cpu=1; shift; }
[ $# -eq 1 ] || { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
R=$(mkdir -p "$1" && cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo" || exit 1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
if [ "$cpu" = 1 ]; then
  ARCH=tiny RECORDS=${RECORDS:-400} WINDOW_MIN=${WINDOW_MIN:-6} BACKEND=hf METHOD=lora BATCHING=padded
  MAX_VRAM_GB=${MAX_VRAM_GB:-0} PRIOR_OVERHEAD=${PRIOR_OVERHEAD:-5}
fi
ARCH=${ARCH:-llama3.1-8b} MODELS_DIR=${MODELS_DIR:-/tmp/models} RECORDS=${RECORDS:-8000} WINDOW_MIN=${WINDOW_MIN:-8}
CAL_SECONDS=${CAL_SECONDS:-15} BACKEND=${BACKEND:-auto} METHOD=${METHOD:-qlora} MAX_VRAM_GB=${MAX_VRAM_GB:-40}
BATCHING=${BATCHING:-packed} PRIOR_OVERHEAD=${PRIOR_OVERHEAD:-60}
PARALLEL=${PARALLEL:-0}
say() { echo "[adapters_gpu $(date -u +%T)] $*" | tee -a "$R/driver.log"; }
if [ "$PARALLEL" = 1 ] && [ "$cpu" = 0 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  [ "${gpus:-0}" -ge 2 ] || { say "PARALLEL=1 needs 2 GPUs (one night on each), found ${gpus:-0}: run without it"; exit 2; }
fi

{
  echo "date: $(date -u +%F)"
  echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/card, memory, driver: /'
  else
    echo "card: none (CPU: $(nproc) cores)"
  fi
  "$PY" -c 'import sys, torch; print("torch:", torch.__version__, "| python:", sys.version.split()[0])' 2>/dev/null
  echo "arch=$ARCH records=$RECORDS window_min=$WINDOW_MIN backend=$BACKEND method=$METHOD batching=$BATCHING parallel=$PARALLEL"
} > "$R/meta.txt"

# 1. the model: random-initialised (GPU), or the demo's tiny Llama (--cpu)
if [ "$ARCH" = tiny ]; then
  MODEL=$R/model
  [ -e "$MODEL/config.json" ] || "$PY" -c 'import sys; from pathlib import Path
from jobs.training.models.tiny import build_tiny_llama
build_tiny_llama(Path(sys.argv[1]), sorted(Path("config/sample-inbox").glob("*.json*")))' "$MODEL" \
    >> "$R/model.log" 2>&1 || { say "could not build the tiny model"; exit 1; }
else
  MODEL=$MODELS_DIR/$ARCH
  "$PY" -m benchmarks.model --path "$MODEL" --result "$R/model.json" --arch "$ARCH" >> "$R/model.log" 2>&1 \
    || { say "could not build $ARCH (see model.log)"; exit 1; }
fi
say "model at $MODEL"

# 2. the records: one inbox of all of them; four inboxes of a quarter each (the same records)
"$PY" - "$MODEL" "$R" "$RECORDS" <<'EOF' || exit 1
import json, random, sys
from pathlib import Path
model, out, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
words = (model / "nightshift_random.json").exists()  # random architectures: a word tokenizer over w0..w255
r = random.Random(43)
rows = []
for i in range(n):
    if words:
        q = " ".join(f"w{r.randrange(256)}" for _ in range(r.randint(10, 60)))
        rows.append({"instruction": f"{q} n{i}", "output": " ".join(f"w{r.randrange(256)}" for _ in range(r.randint(10, 80)))})
    else:
        x, y = r.randint(0, 10**6), r.randint(0, 10**6)
        rows.append({"instruction": f"Compute {x} plus {y}. (#{i})", "output": f"{x} + {y} = {x + y}."})
for name, parts in (("one", 1), ("four", 4)):
    for k in range(parts):
        d = out / name / f"inbox-{k + 1}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[k::parts]))
EOF

# 3. the configs: the same [train] for both; the four adapters differ only in their sources
common() {
  cat <<EOF
state_dir = "$R/$1/state"
[model]
path = "$MODEL"
name = "one"
[plan]
heldout_share = 0.02
prior_overhead_seconds = $PRIOR_OVERHEAD  # until calibrate (or a night) measures it
prior_tokens_per_second = 2000.0
[train]
backend = "$BACKEND"
method = "$METHOD"
batching = "$BATCHING"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
checkpoint_every_seconds = 120
$([ "$cpu" = 1 ] && echo "gradient_checkpointing = false")
[eval]
max_eval_samples = 64
[window]
save_margin_minutes = 0.5
min_run_minutes = 1
EOF
  [ "$MAX_VRAM_GB" != 0 ] && printf '[gpu]\nmax_vram_gb = %s\n' "$MAX_VRAM_GB"
}
{ common one; printf '[[sources]]\nname = "in-1"\ninbox = "%s"\nsettle_seconds = 0\n' "$R/one/inbox-1"; } > "$R/one.toml"
{
  common four
  for k in 1 2 3 4; do printf '[[sources]]\nname = "in-%s"\ninbox = "%s"\nsettle_seconds = 0\n' "$k" "$R/four/inbox-$k"; done
  for k in 1 2 3 4; do printf '[[adapters]]\nname = "task%s"\nsources = ["in-%s"]\n' "$k" "$k"; done
} > "$R/four.toml"
for c in one four; do
  "$PY" -m daemon --config "$R/$c.toml" check-config >> "$R/driver.log" 2>&1 || { say "$c.toml is refused"; exit 1; }
done

# 4. calibrate once, on the night of four's shared state; the night of one gets the same measurement
rm -rf "$R/one/state"
if [ "$cpu" = 0 ] && [ -e "$R/calibrate/calibration.json" ] && [ -e "$R/four/state/ledger.sqlite" ]; then
  say "calibration kept from an earlier run in $R"
  "$PY" - "$R/four/state/ledger.sqlite" <<'EOF2' || exit 1
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])  # the nights of an earlier run go; the calibration stays
for table in ("runs", "samples", "versions", "files", "quarantine", "events", "promotions", "hotswaps", "pins"):
    try:
        db.execute(f"DELETE FROM {table}")
    except sqlite3.OperationalError:
        pass
db.execute("DELETE FROM throughput WHERE origin != 'calibrate'")
db.commit()
EOF2
  find "$R/four/state" -mindepth 1 -maxdepth 1 ! -name 'ledger.sqlite*' ! -name models -exec rm -rf {} +
  mkdir -p "$R/one/state"
  "$PY" -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))' \
    "$R/four/state/ledger.sqlite" "$R/one/state/ledger.sqlite" || exit 1
  ln -s "$R/four/state/models" "$R/one/state/models" 2>/dev/null
elif [ "$cpu" = 0 ]; then
  rm -rf "$R/four/state"; mkdir -p "$R/one/state" "$R/four/state"
  t0=$(date +%s)
  gpu0=(); [ "$PARALLEL" = 1 ] && gpu0=(env CUDA_VISIBLE_DEVICES=0)  # the nights' throughput key: one card's
  "${gpu0[@]}" "$PY" -m daemon --config "$R/four.toml" calibrate --seconds "$CAL_SECONDS" --no-checkpointing-line \
    --out "$R/calibrate" > "$R/calibrate.log" 2>&1
  say "calibrate exit $? in $(( $(date +%s) - t0 )) s"
  "$PY" - "$R/four/state/ledger.sqlite" "$R/one/state/ledger.sqlite" <<'EOF' || exit 1
import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)  # the throughput and calibration rows (no run, no sample yet): one measurement for both nights
EOF
  # one cache of the quantised base for both (calibrate made it under four's state)
  [ -d "$R/four/state/models" ] && [ ! -e "$R/one/state/models" ] && ln -s "$R/four/state/models" "$R/one/state/models"
else
  rm -rf "$R/four/state"; mkdir -p "$R/one/state" "$R/four/state"
  say "calibrate skipped (--cpu: it measures the GPU path)"
fi

# 5. the two nights, each in a window of WINDOW_MIN minutes from its start
night() {
  local t0 rc until
  until=$(date -d "+$WINDOW_MIN min" +%T)
  t0=$("$PY" -c 'import time; print(time.time())')
  timeout --signal=TERM --kill-after=30 $(( WINDOW_MIN * 60 + 120 )) \
    "$PY" -m daemon --config "$R/$1.toml" once --until "$until" > "$R/night-$1.log" 2>&1
  rc=$?
  "$PY" -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.1f}")' "$t0" > "$R/night-$1.seconds"
  echo "$rc" > "$R/night-$1.rc"
  say "night of $1: exit $rc in $(cat "$R/night-$1.seconds") s"
}
if [ "$PARALLEL" = 1 ]; then  # each on its own card at the same time (--cpu: both on the CPU)
  if [ "$cpu" = 0 ]; then
    CUDA_VISIBLE_DEVICES=0 night one & p1=$!
    CUDA_VISIBLE_DEVICES=1 night four & p4=$!
  else
    night one & p1=$!
    night four & p4=$!
  fi
  wait "$p1" "$p4"
else
  night one
  night four
fi

# 6. the figures
PARALLEL=$PARALLEL CPU=$cpu "$PY" - "$R" <<'EOF'
import json, sqlite3, sys
from pathlib import Path
R = Path(sys.argv[1])

def summaries(state):
    db = sqlite3.connect(state / "ledger.sqlite")
    rows = db.execute("SELECT summary FROM runs WHERE summary IS NOT NULL ORDER BY started_at").fetchall()
    return [json.loads(r[0]) for r in rows]

def plan_error(runs):
    pred = sum(r.get("predicted_train_seconds") or 0 for r in runs)
    act = sum(r.get("actual_train_seconds") or 0 for r in runs)
    return None if not pred else round(act / pred - 1, 4)

import os
out = {"meta": (R / "meta.txt").read_text().splitlines(), "parallel": os.environ.get("PARALLEL", "0") == "1"}
for name in ("one", "four"):
    runs = summaries(R / name / "state")
    night = runs[-1] if runs else {}
    each = night.get("adapters") or ([night] if night else [])
    out[name] = {
        "exit": int((R / f"night-{name}.rc").read_text()), "wall_seconds": float((R / f"night-{name}.seconds").read_text()),
        "outcome": night.get("outcome"), "trained_tokens": sum(r.get("trained_tokens") or 0 for r in each),
        "trained_samples": sum(r.get("trained_samples") or 0 for r in each),
        "deferred_samples": sum(r.get("deferred_samples") or 0 for r in each),
        "train_seconds": round(sum(r.get("actual_train_seconds") or 0 for r in each), 1),
        "predicted_train_seconds": round(sum(r.get("predicted_train_seconds") or 0 for r in each), 1),
        "plan_error": plan_error(each),
        "adapters": [{k: r.get(k) for k in ("adapter", "outcome", "version_name", "promoted", "trained_tokens",
                                            "predicted_train_seconds", "actual_train_seconds", "phase_seconds",
                                            "load_info", "losses", "error")} | {"plan_error": plan_error([r])} for r in each],
        "shares": night.get("shares", []),
    }
one, four = out["one"], out["four"]
out["ratio_wall"] = round(four["wall_seconds"] / one["wall_seconds"], 3) if one["wall_seconds"] else None
out["same_tokens"] = one["trained_tokens"] == four["trained_tokens"]
(R / "result.json").write_text(json.dumps(out, indent=2))
md = ["| night | exit | outcome | wall s | trained tokens | train s (predicted) | plan error |", "|---|---|---|---|---|---|---|"]
for name in ("one", "four"):
    x = out[name]
    md.append(f"| {name} | {x['exit']} | {x['outcome']} | {x['wall_seconds']} | {x['trained_tokens']:,} | "
              f"{x['train_seconds']} ({x['predicted_train_seconds']}) | {x['plan_error']} |")
md.append(f"\nfour / one (wall): {out['ratio_wall']}; the same tokens trained: {out['same_tokens']}"
          + ("; the two nights ran at the same time, " + ("both on the CPU" if os.environ.get("CPU") == "1" else
                                                             "each on its own card") if out["parallel"] else ""))
(R / "result.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
