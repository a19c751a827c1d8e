#!/usr/bin/env bash
# issue 16: micro-benchmarks — FA2 varlen vs cuDNN ragged attention; the quantisation kernel and LoRA adds against bandwidth
set -u
R=/tmp/sAD; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== attn $(date +%T)"; timeout 200 python3 results/tmp/attn_bench.py $R/attn.json > $R/attn.log 2>&1; echo "exit $?"
echo "=== quant $(date +%T)"; timeout 200 python3 results/tmp/quant_bench.py $R/quant.json > $R/quant.log 2>&1; echo "exit $?"
touch $R/DONE
