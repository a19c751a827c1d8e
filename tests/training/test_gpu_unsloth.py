"""GPU checks of the unsloth backend (run through the device tool; skipped without CUDA/unsloth).

python -m pytest tests/training/test_gpu_unsloth.py -q -m gpu
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
from tests.training.conftest import random_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("unsloth") is None, reason="needs CUDA and unsloth"
    ),
]



@pytest.fixture(scope="module")
def loaded(small_model, tmp_path_factory):
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth

    state = tmp_path_factory.mktemp("state")
    model, tok, info = load_unsloth(
        small_model, lora=LoraSpec(r=16, alpha=16), max_seq_length=8192, gradient_checkpointing=False, cache_dir=state
    )
    return model, tok, info, state


def test_trainable_parameters_recorded(loaded):
    _, _, info, _ = loaded
    # r=16 on q,k,v,o,gate,up,down of 2 layers (hidden 1024, kv 256, intermediate 2816)
    per_layer = 16 * ((1024 + 1024) * 2 + (1024 + 256) * 2 + (1024 + 2816) * 3)
    assert info["trainable_parameters"] == 2 * per_layer
    assert info["trainable_in_experts"] == 0
    assert info["packed_attention"] in ("native", "patched")


def test_packed_equals_alone_through_unsloth(loaded):
    """Unsloth's varlen path: packed loss == token-weighted per-sample losses (bf16 tolerance), and
    the same row without reset positions (cross-sample attention) differs by more than that."""
    from jobs.data.batching import IGNORE_INDEX
    from jobs.training.packing import pack
    from jobs.training.step import model_inputs

    model, _, _, _ = loaded
    samples = random_samples(12, 32000, seed=1)
    counts = [sum(1 for x in s.labels[1:] if x != IGNORE_INDEX) for s in samples]
    total = sum(counts)
    b = pack(samples)
    with torch.no_grad():
        alone = 0.0
        for s, c in zip(samples, counts, strict=True):
            out = model(
                input_ids=torch.tensor([s.input_ids], device="cuda"),
                labels=torch.tensor([s.labels], device="cuda"),
                use_cache=False,
            )
            alone += float(out.loss) * c / total
        packed = float(model(**model_inputs(b, "cuda", unsloth=True)).loss)
        inferred = float(model(**{k: v for k, v in model_inputs(b, "cuda").items()}).loss)
        ids = torch.tensor(b.input_ids, device="cuda")
        leaky = float(model(input_ids=ids, labels=torch.tensor(b.labels, device="cuda"), use_cache=False).loss)
    assert packed == pytest.approx(alone, rel=2e-3)
    assert inferred == pytest.approx(alone, rel=2e-3)  # lengths inferred from position_ids
    assert abs(leaky - alone) > 5 * abs(packed - alone)


def test_steps_and_parent_adapter_roundtrip(loaded, small_model, tmp_path):
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, _, _, state = loaded
    opt = make_optimizer(model, lr=1e-3)
    batches = list(packed_batches(random_samples(120, 32000), tokens_per_step=4096))[:3]
    stats = [train_step(model, b, opt) for b in batches]
    assert len(stats) == 3 and all(s.loss == s.loss for s in stats)
    model.save_pretrained(str(tmp_path / "adapter"))
    saved = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    m2, _, info2 = load_unsloth(
        small_model,
        lora=LoraSpec(r=8),
        max_seq_length=8192,
        gradient_checkpointing=False,
        parent_adapter=tmp_path / "adapter",
        cache_dir=state,
    )
    assert info2["lora"]["r"] == 16  # the parent's shape wins
    assert info2["base_cache_hit"]  # the first load saved the NF4 base
    got = {n: p.detach().float().cpu() for n, p in m2.named_parameters() if p.requires_grad}
    assert got.keys() == saved.keys()
    for n in saved:
        torch.testing.assert_close(got[n], saved[n], msg=n)


def test_two_nights_through_the_unsloth_backend(small_model, tmp_path):
    """The real night on the GPU: unsloth backend, packed steps, NVML energy, the second night continuing."""
    import json
    import shutil
    import threading
    import time

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
        "train": {"backend": "unsloth", "batching": "packed", "tokens_per_step": 4096, "epochs": 2,
                  "gradient_checkpointing": False, "max_seq_length": 512},
        "gpu": {"max_vram_gb": 40, "sample_hz": 5},
    })
    events: list[dict] = []
    s1 = run_night(cfg, night="n1", deadline=time.time() + 1800, emit=lambda e: events.append(e.model_dump()),
                   stop=threading.Event()).model_dump()
    assert s1["outcome"] in ("succeeded", "rejected"), s1["error"]
    manifest = json.loads((cfg.state_dir / "adapters" / "gpu-v0001" / "manifest.json").read_text())
    t = manifest["training"]
    assert t["backend"] == "unsloth" and t["batching"] == "packed" and t["tokens_per_step"] == 4096
    assert s1["gpu"]["energy_joules"] > 0 and s1["gpu"]["peak_reserved_bytes"] > 0
    assert manifest["energy"]["tokens_per_joule"] > 0
    assert any(e["event"] == "gpu" for e in events)
    print("night 1:", json.dumps({k: s1[k] for k in ("trained_samples", "tokens_per_second", "steps", "gpu")}))

    shutil.copy(SAMPLE_INBOX / "chat-2026-11-20.json", inbox / "b.json")
    s2 = run_night(cfg, night="n2", deadline=time.time() + 1800, emit=lambda e: events.append(e.model_dump()),
                   stop=threading.Event()).model_dump()
    assert s2["outcome"] in ("succeeded", "rejected") and s2["parent_version"] == (1 if s1["promoted"] else None)
    assert s2["trained_samples"] > 0
    print("night 2:", json.dumps({k: s2[k] for k in ("trained_samples", "tokens_per_second", "steps")}))
