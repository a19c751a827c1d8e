#!/usr/bin/env bash
set -u
R=/tmp/sAR; mkdir -p $R; cd "$(dirname "$0")/../.."
exec > $R/driver.log 2>&1
export PYTHONUNBUFFERED=1
timeout 200 python3 results/tmp/nf4bench.py $NF4_VARIANTS > $R/nf4bench.log 2>&1; echo "exit $?"; cat $R/nf4bench.log | tail -20
touch $R/DONE
