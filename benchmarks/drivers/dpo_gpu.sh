#!/usr/bin/env bash
# A preference (DPO) night of an 8B on one GPU, through the product's own commands (issue 45):
# a random-initialised model, preference records in an inbox, `nightshift calibrate` (objective "dpo": the DPO
# night's steps, under its own throughput key), then `nightshift once --until +N min`; records the plan's
# predicted against the actual training seconds (plan error), tokens/s, peak GB and J per 1k tokens.
#
#   benchmarks/drivers/dpo_gpu.sh OUT_DIR
#
# Environment (all optional):
#   MODEL        a model directory to use as it is; default: ARCH built random-initialised under MODELS (kept there,
#                reused by a later call on the same machine)
#   ARCH         llama3.1-8b          MODELS  /tmp/nightshift-models (the bench's own folder)
#   PAIRS        preference records written to the inbox (more than a night takes: the plan cuts)    default 6000
#   UNTIL_S      the night's window, seconds from its start (`once --until`)                      default 300
#                (it must hold the child's start, ~30 s, and calibrate's measured overheads, 62 s for the 8B on an
#                H200, before any training: an 80-s window planned nothing, 2026-11-28)
#   WORK         the state directory's and the inbox's folder (keep it out of $OUT on the device)   default OUT_DIR/work
#   CAL_SECONDS  calibrate's timed seconds per length profile                                      default 5
#   PRIOR_TPS    the configured prior (used only where calibrate measured nothing: a CPU run)     default 6000
#   MAX_SEQ      [train] max_seq_length                                                            default 2048
#   PROMPT_WORDS, REPLY_WORDS  words of a prompt / of each reply, as LOW-HIGH                  default 20-120, 50-250
# Output in OUT_DIR: meta.txt (date, commit, card, driver, torch), driver.log (each step's command, exit, seconds),
# calibrate.log, once.log, calibration/, and dpo_night.json (the figures: see summarize below).
# CPU check (tiny model; calibrate refuses without CUDA and the night plans from the prior):
#   MODEL=/path/to/tiny PAIRS=60 UNTIL_S=120 MAX_SEQ=256 PROMPT_WORDS=2-6 REPLY_WORDS=2-8 PRIOR_TPS=300 \
#     benchmarks/drivers/dpo_gpu.sh /tmp/dpo-cpu
set -uo pipefail

[ $# -eq 1 ] || { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
R=$(mkdir -p "$1" && cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo" || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
ARCH=${ARCH:-llama3.1-8b} MODELS=${MODELS:-/tmp/nightshift-models} PAIRS=${PAIRS:-6000} UNTIL_S=${UNTIL_S:-300}
CAL_SECONDS=${CAL_SECONDS:-5} PRIOR_TPS=${PRIOR_TPS:-6000} MAX_SEQ=${MAX_SEQ:-2048}
PROMPT_WORDS=${PROMPT_WORDS:-20-120} REPLY_WORDS=${REPLY_WORDS:-50-250}
W=${WORK:-$R/work}; mkdir -p "$W/inbox"
log() { echo "$*" >> "$R/driver.log"; }
step() {  # step NAME TIMEOUT CMD...: its output to NAME.log, its exit status and seconds to driver.log
  local name=$1 t=$2; shift 2
  local s; s=$(date +%s)
  log "=== $name $(date -u +%T): $*"
  timeout --signal=TERM --kill-after=30 "$t" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  log "$name exit $rc in $(( $(date +%s) - s )) s"
  return $rc
}

{
  echo "date: $(date -u +%F)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/card, memory, driver: /'
  else
    echo "card: none (CPU: $(nproc) cores)"
  fi
  python3 -c 'import sys, torch; print("torch:", torch.__version__, "| python:", sys.version.split()[0])' 2>/dev/null
} > "$R/meta.txt"

if [ -z "${MODEL:-}" ]; then
  MODEL=$MODELS/$ARCH
  step build 180 python3 -c "
from pathlib import Path
from benchmarks.model import resolve_model
from benchmarks.settings import BenchSettings
print(resolve_model(BenchSettings(arch='$ARCH', models_dir=Path('$MODELS'))))" || exit 1
fi

cat > "$W/nightshift.toml" <<TOML
state_dir = "$W/state"
[model]
path = "$MODEL"
name = "dpo"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
settle_seconds = 0
[train]
backend = "auto"
batching = "packed"
compute = "bf16"
objective = "dpo"
dpo_beta = 0.1
lora_rank = 16
lora_alpha = 16
max_seq_length = $MAX_SEQ
gradient_checkpointing = false
[plan]
prior_tokens_per_second = $PRIOR_TPS
prior_overhead_seconds = 30
[gpu]
max_vram_gb = 40
[window]
save_margin_minutes = 0.25
min_run_minutes = 1
TOML

# Preference records: a prompt, a chosen and a rejected reply of random words (lengths as the supervised rows'
# "20-120 / 50-250" words by default), a quarter as an edit of the reply (chosen) over the original (rejected).
# Chosen replies draw from words w0-w127, rejected ones from w128-w255: a preference the held-out pairs share,
# so the gate's reward accuracy has something to find.
python3 - "$W/inbox/pairs.jsonl" "$PAIRS" "$PROMPT_WORDS" "$REPLY_WORDS" <<'PY' || exit 1
import json, random, sys
out, n = sys.argv[1], int(sys.argv[2])
(p0, p1), (a0, a1) = (map(int, x.split("-")) for x in sys.argv[3:5])
r = random.Random(45)
w = lambda k, lo=0, hi=256: " ".join(f"w{r.randrange(lo, hi)}" for _ in range(k))
with open(out, "w") as f:
    for i in range(n):
        prompt = f"{w(r.randint(p0, p1))} p{i}"
        if i % 4 == 3:
            rec = {"prompt": prompt, "reply": w(r.randint(a0, a1), 128), "edited": w(r.randint(a0, a1), 0, 128)}
        else:
            rec = {"prompt": prompt, "chosen": w(r.randint(a0, a1), 0, 128), "rejected": w(r.randint(a0, a1), 128)}
        f.write(json.dumps(rec) + "\n")
PY

NS=(python3 -m daemon --config "$W/nightshift.toml")
step calibrate 180 "${NS[@]}" calibrate --seconds "$CAL_SECONDS" --no-checkpointing-line --out "$R/calibration"
until=$(date -d "+$UNTIL_S sec" +%H:%M:%S)
step once $(( UNTIL_S + 120 )) "${NS[@]}" once --until "$until"

# The figures, from the ledger and the published manifest (read-only).
python3 - "$W/state" "$R/dpo_night.json" <<'PY'
import json, sys
from pathlib import Path
from jobs.store.readonly import open_read_only
state, out = Path(sys.argv[1]), Path(sys.argv[2])
led = open_read_only(state / "ledger.sqlite")
try:
    run = led.db.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
    s = led.summary_of(run) if run is not None else None
    cal = [dict(r) for r in led.db.execute("SELECT key, origin, tokens, seconds, tokens_per_second FROM throughput "
                                          "ORDER BY at")]
finally:
    led.close()
doc = {"run": None if run is None else {"status": run["status"], "error": run["error"]}, "throughput": cal}
if s is not None:
    pred, act = s.predicted_train_seconds, s.actual_train_seconds
    gpu = s.gpu
    tokens = s.trained_tokens or 0
    doc.update(
        outcome=s.outcome.value, promoted=s.promoted, trained_pairs=s.trained_samples,
        preference_pairs=s.preference_pairs, cut_pairs=s.cut_samples, trained_tokens=tokens,
        planned_tokens=s.planned_tokens, predicted_train_seconds=pred, actual_train_seconds=act,
        plan_error=(act / pred - 1) if pred and act else None, tokens_per_second=s.tokens_per_second,
        plan_tokens_per_second=s.plan.tokens_per_second if s.plan else None, plan_basis=s.plan_basis,
        step_shape=s.step_shape.model_dump() if s.step_shape else None,
        peak_reserved_gb=gpu.peak_reserved_bytes / 1e9 if gpu and gpu.peak_reserved_bytes else None,
        peak_allocated_gb=gpu.peak_allocated_bytes / 1e9 if gpu and gpu.peak_allocated_bytes else None,
        energy_joules=gpu.energy_joules if gpu else None, mean_power_watts=gpu.mean_power_watts if gpu else None,
        joules_per_1k_tokens=(gpu.energy_joules / tokens * 1000) if gpu and gpu.energy_joules and tokens else None,
        gate=s.gate.model_dump() if s.gate else None, phase_seconds=s.phase_seconds, error=s.error)
out.write_text(json.dumps(doc, indent=1, default=str))
print(json.dumps({k: doc.get(k) for k in ("outcome", "promoted", "trained_pairs", "predicted_train_seconds",
                                          "actual_train_seconds", "plan_error", "tokens_per_second",
                                          "plan_tokens_per_second", "peak_reserved_gb", "joules_per_1k_tokens")}))
PY
"${NS[@]}" report --json > "$R/report.json" 2> "$R/report.err"
