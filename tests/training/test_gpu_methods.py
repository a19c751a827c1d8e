"""GPU checks of `[train] method = "lora"` and `"full"` through the unsloth backend (skipped without CUDA/unsloth).

python -m pytest tests/training/test_gpu_methods.py -q -m gpu -s
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
from tests.training.conftest import random_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("unsloth") is None, reason="needs CUDA and unsloth"
    ),
]



def test_full_packed_rows_equal_their_samples_and_every_weight_trains(small_model, tmp_path):
    """FastModel's full fine-tuning with packed rows: the packed loss equals the samples' own (no
    attention across samples), the 8-bit optimizer stepped in backward moves every weight, and the
    saved version is a model transformers loads."""
    from jobs.data.batching import IGNORE_INDEX
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.config import TrainConfig
    from jobs.training.optim import OptimizerChoice, build_optimizer
    from jobs.training.packing import pack, packed_batches
    from jobs.training.step import model_inputs, train_step

    model, tok, info = load_unsloth(small_model, lora=LoraSpec(), method="full", max_seq_length=8192,
                                    gradient_checkpointing=False)
    print("full load:", json.dumps({k: info[k] for k in ("packed_attention", "trainable_parameters",
                                                          "total_parameters", "load_seconds")}))
    assert info["trainable_parameters"] == info["total_parameters"]
    rows = random_samples(12, 32000, seed=1)
    counts = [sum(1 for x in s.labels[1:] if x != IGNORE_INDEX) for s in rows]
    with torch.no_grad():
        alone = sum(float(model(input_ids=torch.tensor([s.input_ids], device="cuda"),
                                labels=torch.tensor([s.labels], device="cuda"), use_cache=False).loss) * c
                    for s, c in zip(rows, counts, strict=True)) / sum(counts)
        packed = float(model(**model_inputs(pack(rows), "cuda", unsloth=True)).loss)
    assert packed == pytest.approx(alone, rel=5e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainConfig(method="full", learning_rate=1e-4),
                          OptimizerChoice("adamw_8bit", True, "test"), device="cuda")
    for b in list(packed_batches(random_samples(200, 32000, seed=2), tokens_per_step=4096))[:3]:
        st = train_step(model, b, opt)
        assert st.loss == st.loss
    moved = sum(1 for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n]))
    assert moved == len(before)
    try:
        from unsloth.utils.hf_packed_attention import HF_PACKED_ATTENTION_STATS

        print("hf packed attention:", HF_PACKED_ATTENTION_STATS)
    except ImportError:
        pass
    from transformers import AutoModelForCausalLM

    from jobs.contract import Method
    from jobs.training.load import Loaded
    from jobs.training.save import save_version

    save_version(Loaded(model, tok, "unsloth", "cuda", info, Method.full), tmp_path / "v")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "v", dtype=torch.bfloat16).cuda()
    name = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(dict(again.named_parameters())[name].float(),
                               dict(model.named_parameters())[name].detach().float())


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_nights_of_each_method(small_model, tmp_path, method):
    """The real night on the GPU: the second night continues the first one's adapter or model."""
    from jobs.night.config import NightConfig
    from jobs.night.run import run_night
    from tests.conftest import SAMPLE_INBOX

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(SAMPLE_INBOX / "alpaca-2026-11-20.jsonl", inbox / "a.jsonl")
    cfg = NightConfig.model_validate({
        "state_dir": tmp_path / "state", "model": {"path": small_model, "name": "gpu"},
        "sources": [{"name": "inbox", "inbox": inbox, "settle_seconds": 0}],
        "plan": {"prior_tokens_per_second": 5000, "prior_overhead_seconds": 60},
        "train": {"backend": "unsloth", "method": method, "batching": "packed", "tokens_per_step": 4096,
                  "gradient_checkpointing": False, "max_seq_length": 512, "checkpoint_every_seconds": 1},
        "gpu": {"max_vram_gb": 40, "sample_hz": 5},
    })
    out = []
    for night, extra in (("n1", None), ("n2", "chat-2026-11-20.json")):
        if extra:
            shutil.copy(SAMPLE_INBOX / extra, inbox / extra)
        s = run_night(cfg, night=night, deadline=time.time() + 1800, emit=lambda e: None,
                      stop=threading.Event()).model_dump(mode="json")
        assert s["outcome"] in ("succeeded", "rejected"), s["error"]
        out.append(s)
    m = json.loads((cfg.state_dir / "adapters" / "gpu-v0002" / "manifest.json").read_text())
    t = m["training"]
    shown = ("tokens_per_second", "optimizer", "optimizer_in_backward", "packed_attention", "quantized_4bit",
             "trainable_parameters", "continued_from")
    print(f"{method}:", json.dumps({k: t.get(k) for k in shown}))
    assert m["method"] == method and t["backend"] == "unsloth" and t["quantized_4bit"] is False
    assert out[1]["parent_version"] == (1 if out[0]["promoted"] else None)
    if method == "full":
        assert m["kind"] == "model" and t["trainable_parameters"] == t["total_parameters"]
        assert "config.json" in m["files"] and "tokenizer.json" in m["files"]
    else:
        assert m["kind"] == "adapter" and "adapter_model.safetensors" in m["files"]
