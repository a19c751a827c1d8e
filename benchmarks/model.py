"""The benchmarked model: found, or built random-initialised, in a child process; never in the parent.

The parent holds no GPU memory while its workers run (a bf16 build left 18 GB in the parent once, and
a Qwen3-32B probe beside it went out of memory on an 80 GB card). So the parent imports neither torch
nor transformers: a model it can describe from its files (the marker `build_random_model` writes) is
read as JSON; anything else — building, or reading a config through transformers — happens in
`python -m benchmarks.model`, whose exit frees what it used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.training.models.architectures import MARKER  # the module imports torch only inside its builders

if TYPE_CHECKING:
    from benchmarks.settings import BenchSettings


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    matmul_params: int  # weights a token meets in matrix products (MFU's denominator / 4)


def resolve_model(s: BenchSettings) -> ModelInfo:
    """Parent side: the model directory and its matmul parameters, without torch in this process.

    `--model DIR` is used as it is; `--arch NAME` is built under `--models-dir` unless it is there.
    """
    if s.model is not None:
        path, build = s.model, None
    else:
        assert s.arch  # BenchSettings requires one of the two
        path, build = s.models_dir / (s.arch + ("-nf4" if s.build_4bit else "")), s.arch
    t0 = time.time()
    info = from_marker(path, build, s.build_4bit) or _in_child(path, build, s.build_4bit)
    print(f"model {s.arch or path.name} at {path} ({time.time() - t0:.0f} s to build or find)", flush=True)
    return info


def in_memory_model(s: BenchSettings) -> ModelInfo:
    """The moe stack builds --arch in GPU memory itself: nothing to build or find here, and its matmul
    parameters come from the architecture's table (no transformers in the parent)."""
    from types import SimpleNamespace

    from jobs.training.models.architectures import ARCHITECTURES, matmul_params

    assert s.arch  # BenchSettings requires it with --in-memory
    if s.arch not in ARCHITECTURES:
        raise SystemExit(f"bench: unknown architecture {s.arch!r}; known: {', '.join(ARCHITECTURES)}")
    return ModelInfo(Path(f"in-memory:{s.arch}"), matmul_params(SimpleNamespace(**ARCHITECTURES[s.arch])))


def from_marker(path: Path, arch: str | None, build_4bit: bool) -> ModelInfo | None:
    """A random-initialised model built before (with this arch and quantisation when `arch` is given)."""
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if arch is not None and (meta.get("arch") != arch or meta.get("load_in_4bit") != build_4bit):
        return None
    if not isinstance(meta.get("matmul_params"), int) or not (path / "config.json").exists():
        return None
    return ModelInfo(path, meta["matmul_params"])


def _in_child(path: Path, arch: str | None, build_4bit: bool) -> ModelInfo:
    with tempfile.TemporaryDirectory(prefix="nightshift-bench-") as tmp:
        result = Path(tmp) / "model.json"
        argv = [sys.executable, "-m", "benchmarks.model", "--path", str(path), "--result", str(result)]
        argv += ["--arch", arch] if arch else []
        argv += ["--build-4bit"] if build_4bit else []
        rc = subprocess.run(argv, check=False).returncode
        if rc != 0 or not result.exists():
            raise SystemExit(f"bench: could not {'build' if arch else 'read'} the model at {path} (exit {rc})")
        doc = json.loads(result.read_text())
    return ModelInfo(Path(doc["path"]), int(doc["matmul_params"]))


def vocab_size(model_path: Path) -> int:
    cfg = json.loads((model_path / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def main(argv: list[str] | None = None) -> int:
    """The child: build `--arch` into `--path` unless it is there, then describe it into `--result`."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.model")
    ap.add_argument("--path", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--arch")
    ap.add_argument("--build-4bit", action="store_true")
    a = ap.parse_args(argv)
    from transformers import AutoConfig

    from jobs.training.models.architectures import build_random_model, matmul_params

    if a.arch:
        build_random_model(a.arch, a.path, load_in_4bit=a.build_4bit)
    config = AutoConfig.from_pretrained(str(a.path), local_files_only=True)
    a.result.write_text(json.dumps({"path": str(a.path), "matmul_params": matmul_params(config)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
