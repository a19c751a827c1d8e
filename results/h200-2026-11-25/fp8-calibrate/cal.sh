#!/usr/bin/env bash
# nightshift calibrate of a random-initialised Llama-3.1-8B under max_vram_gb = 40, FP8 then bf16 (issue 16)
set -u
W=/tmp/cal; mkdir -p $W/inbox
python3 -m jobs.bench.model --path /tmp/m8 --arch llama3.1-8b --result $W/model.json > $W/model.log 2>&1 || { tail -5 $W/model.log; exit 1; }
for v in ${VARIANTS:-fp8 bf16}; do
c=${v%%-*}
cat > $W/$v.toml <<TOML
state_dir = "$W/state"
[model]
path = "/tmp/m8"
name = "m8"
[[sources]]
name = "inbox"
inbox = "$W/inbox"
[train]
backend = "auto"
batching = "packed"
compute = "$c"
lora_rank = 16
lora_alpha = 16
max_seq_length = 2048
[gpu]
max_vram_gb = 40
TOML
s=$(date +%s.%N)
E=""; [ "$v" = fp8-eager ] && E="NIGHTSHIFT_FP8_EAGER=1"
env $E timeout 240 python3 -m daemon --config $W/$v.toml calibrate --seconds 10 --no-checkpointing-line --out $OUT/calibrate-$v > $OUT/calibrate-$v.log 2>&1
echo "calibrate $v: exit $? in $(python3 -c "print(round($(date +%s.%N)-$s,1))") s"
done
