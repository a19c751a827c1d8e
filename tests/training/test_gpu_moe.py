"""GPU checks of nightshift's MoE path (issue 15; run through the device tool; skipped without CUDA).

    python -m pytest tests/training/test_gpu_moe.py -q -m gpu -s

No Unsloth here (it patches transformers at import): tests/training/test_gpu_moe_unsloth.py, in its own process.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                       reason="needs CUDA and bitsandbytes"),
]


def test_flash_varlen_with_sinks_equals_per_sample_attention_at_gpt_oss_shapes():
    """64 query heads, 8 K/V heads, head 64, a 128-token window, samples shorter and longer than it."""
    from jobs.training.moe.packed_attention import flash_attention, sdpa_attention, segments

    lengths, h, kv, d = [17, 300, 128, 5, 700], 64, 8, 64
    t = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    base = [torch.randn(1, n, t, d, device="cuda", generator=g) for n in (h, kv, kv)]
    sinks = torch.randn(h, device="cuda", generator=g)
    weight = torch.randn(1, t, h, d, device="cuda", generator=g)
    res = {}
    for name, fn, dtype in (("flash", flash_attention, torch.bfloat16), ("sdpa", sdpa_attention, torch.float32)):
        q, k, v = (x.to(dtype).requires_grad_() for x in base)
        for window in (128, None):
            out = fn(q, k, v, segments(pos, 1, t, t, "cuda"), d**-0.5, window, sinks)
            (out.float() * weight).sum().backward()
        res[name] = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for n, a, b in zip(("out", "dq", "dk", "dv"), res["flash"], res["sdpa"], strict=True):
        err = float((a - b).abs().max() / b.abs().max())
        print(f"flash vs fp32 per-sample: {n} max rel err {err:.2e}")
        assert err < 4e-2, n  # bf16 against fp32


def test_nf4_grouped_expert_gemms():
    from jobs.training.moe.experts_nf4 import self_check

    r = self_check("cuda")
    print(r)
    assert r["ok"], r


@pytest.fixture(scope="module")
def small_moe():
    from jobs.training.moe.build import build_random_in_memory
    from jobs.training.moe.load import prepare_moe_for_training

    model, tok, info = build_random_in_memory("gpt-oss-small", device="cuda")
    loaded = prepare_moe_for_training(model, tok, r=16, alpha=16, build_info=info)
    print({k: v for k, v in loaded.info.items() if not isinstance(v, dict)})
    return loaded


def test_in_memory_gpt_oss_small_is_nf4_with_lora_on_every_expert(small_moe):
    i = small_moe.info
    assert i["quantized"] == "nf4" and i["quantized_linear_layers"] == 8 and i["built_in_memory"]
    assert i["trainable_matches_expected"] and i["trainable_parameters"] == 15_409_152  # 0.66 M attn + 14.7 M experts
    assert i["trainable_in_experts"] == 14_745_600 and i["experts_routed_through_grouped_gemm"] == 2
    assert i["expert_weights_gb"] < 1.0  # 2 layers x 32 experts in NF4: ~0.83 GB (bf16: 3.2 GB)


def test_packed_rows_keep_samples_apart_on_the_gpu(small_moe):
    from jobs.data.batching import TokenizedSample
    from jobs.training.packing import pack
    from jobs.training.step import model_inputs

    model = small_moe.model
    g = torch.Generator().manual_seed(1)
    samples = [TokenizedSample(i, ids, ids) for i, n in enumerate([30, 200, 150, 9, 400])
               for ids in [torch.randint(16, 200000, (n,), generator=g).tolist()]]
    counts = [len(s.input_ids) - 1 for s in samples]
    with torch.no_grad():
        alone = sum(float(model(input_ids=torch.tensor([s.input_ids], device="cuda"),
                                labels=torch.tensor([s.labels], device="cuda"), use_cache=False).loss) * c
                    for s, c in zip(samples, counts, strict=True)) / sum(counts)
        b = pack(samples)
        packed = float(model(**model_inputs(b, "cuda")).loss)
        leaky = float(model(input_ids=torch.tensor(b.input_ids, device="cuda"),
                            labels=torch.tensor(b.labels, device="cuda"), use_cache=False).loss)
    # the leak of one causal sequence over the row is printed, not asserted: at random init with 2 layers it
    # can be as small as bf16 noise (the CPU tests assert it, in fp32)
    print(f"alone {alone:.5f} packed {packed:.5f} one-sequence {leaky:.5f}")
    # bf16 noise can flip a token's top-k experts between the two runs: 0.38 % seen once on an H200 (a leak
    # across samples is asserted in fp32 by the CPU tests)
    assert packed == pytest.approx(alone, rel=1e-2)


def test_packed_steps_train_every_expert_lora_tensor(small_moe):
    from jobs.training.models.synthetic import make_samples
    from jobs.training.moe.lora import ExpertLoraWatch
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model = small_moe.model
    watch = ExpertLoraWatch(model)
    opt = make_optimizer(model, lr=1e-3)
    batches = list(packed_batches(make_samples("alpaca", 40_000, vocab=201088), tokens_per_step=8192))[:5]
    stats = [train_step(model, b, opt) for b in batches]
    print("steps:", [(round(s.loss, 4), round(s.seconds, 3), s.tokens) for s in stats])
    r = watch.finish()
    print(r.model_dump())
    assert (r.tensors, r.with_grad, r.moved, r.nonfinite, r.problems) == (8, 8, 8, 0, [])
    assert r.slices_moved == r.expert_slices == 8 * 32
