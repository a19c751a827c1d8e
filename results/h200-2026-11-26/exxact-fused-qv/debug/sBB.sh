#!/usr/bin/env bash
set -u
R=/tmp/sBB; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
timeout 300 python3 results/tmp/dbgBB.py 2>&1 | grep -v Warning | tail -60
touch $R/DONE
