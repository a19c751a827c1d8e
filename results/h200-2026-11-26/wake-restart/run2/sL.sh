#!/usr/bin/env bash
# issue 11, again after closing the pull's workers without waiting: night 1 and night 2 of the 8B (60,000 new
# records each) through `once`, a child started inside its window; the first step's seconds logged apart.
# Then the first training step's compile in a fresh process: alone, and after a warm-up step of another length
# in a thread (does a warm-up take it off the first real step?).
set -u
R=/tmp/sL; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
stamp() { echo "=== $1 $(date +%T)"; }
W=/tmp/n12; mkdir -p $W/inbox
drop() { python3 - "$@" <<PY
import sys
from pathlib import Path
from jobs.bench.acceptance.run import records, write_jsonl
night, n = int(sys.argv[1]), int(sys.argv[2])
write_jsonl(Path("$W/inbox/night%d.jsonl" % night), records("words", n, night))
PY
}
stamp build
python3 -c "
from pathlib import Path
from jobs.bench.model import resolve_model
from jobs.bench.settings import BenchSettings
print(resolve_model(BenchSettings(arch='llama3.1-8b', models_dir=Path('/tmp/models'))))" > $R/build.log 2>&1
sed "s#/tmp/n11#$W#g" results/tmp/sK.sh | sed -n '/^cat > \$W\/n.toml <<TOML/,/^TOML/p' | sed '1d;$d' | sed "s#\$W#$W#g" > $W/n.toml
cat $W/n.toml
for n in 1 2; do
  drop $n 60000
  stamp night$n; s=$(date +%s)
  until=$([ $n = 1 ] && echo '+150 sec' || echo '+210 sec')
  timeout 400 python3 -m daemon --config $W/n.toml once --until "$(date -d "$until" +%H:%M:%S)" > $R/once$n.log 2>&1
  echo "once exit $? in $(( $(date +%s) - s )) s"
  python3 -m daemon --config $W/n.toml report --json > $R/report$n.json 2> $R/report$n.err
done
for mode in alone thread; do
  stamp warm-$mode; s=$(date +%s)
  timeout 150 python3 results/tmp/warmcompile.py /tmp/models/llama3.1-8b $W/state/models $mode > $R/warm-$mode.log 2>&1
  echo "warm $mode exit $? in $(( $(date +%s) - s )) s"; tail -1 $R/warm-$mode.log
done
stamp done; touch $R/DONE
