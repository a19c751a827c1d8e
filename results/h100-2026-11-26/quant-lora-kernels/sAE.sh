#!/usr/bin/env bash
# issue 16: sweep a multi-row quantisation kernel and a LoRA expand-and-add kernel against today's kernel and addmm_
set -u
R=/tmp/sAE; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
echo "=== sweep $(date +%T)"; timeout 420 python3 results/tmp/sweep_kernels.py $R/sweep.json > $R/sweep.log 2>&1; echo "exit $?"
touch $R/DONE
