"""GPU: a night of the small GPT-OSS through the unsloth backend records the expert LoRA check (issue 15).

    python -m pytest tests/training/test_gpu_moe_unsloth.py -q -m gpu -s     (its own process: Unsloth patches)

Also prints, without asserting, whether Unsloth's GPT-OSS attention keeps packed samples apart (it blocks
padding-free batching for GPT-OSS: flex attention); nightshift's own MoE path does (test_gpu_moe.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("unsloth") is None,
                       reason="needs CUDA and unsloth"),
]


def test_unsloth_night_of_gpt_oss_small_trains_every_expert_lora_tensor(tmp_path):
    import unsloth  # noqa: F401  (before transformers' models are used)

    from jobs.night.config import NightConfig
    from jobs.night.run import run_night
    from jobs.training.models.architectures import build_random_model
    from tests.conftest import SAMPLE_INBOX

    model = build_random_model("gpt-oss-small", tmp_path / "gpt-oss-small")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(SAMPLE_INBOX / "alpaca-2026-11-20.jsonl", inbox / "a.jsonl")
    cfg = NightConfig.model_validate({
        "state_dir": tmp_path / "state", "model": {"path": model, "name": "moe"},
        "sources": [{"name": "inbox", "inbox": inbox, "settle_seconds": 0}],
        "plan": {"prior_tokens_per_second": 5000, "prior_overhead_seconds": 60},
        "train": {"backend": "unsloth", "batching": "packed", "tokens_per_step": 4096, "lora_rank": 16,
                  "gradient_checkpointing": False, "max_seq_length": 512},
        "gpu": {"max_vram_gb": 60, "sample_hz": 5},
    })
    s = run_night(cfg, night="n1", deadline=time.time() + 1200, emit=lambda e: None,
                  stop=threading.Event()).model_dump()
    print("night:", json.dumps({k: s[k] for k in ("outcome", "error", "steps", "tokens_per_second", "expert_lora")}))
    print("load:", json.dumps({k: v for k, v in s["load_info"].items() if "param" in k or "expert" in k}))
    assert s["outcome"] in ("succeeded", "rejected"), s["error"]
    e = s["expert_lora"]
    assert e["tensors"] == 8 and e["with_grad"] == 8 and e["moved"] == 8, e
