"""Mixture-of-experts training on the CPU (issue 15): LoRA reaches the experts, the expert check, packed
attention with sinks and windows, grouped expert GEMMs, the in-memory build."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest

torch = pytest.importorskip("torch")

from jobs.training.models.architectures import make_config  # noqa: E402
from jobs.training.moe.lora import (  # noqa: E402
    ExpertLoraError,
    ExpertLoraWatch,
    expected_lora_parameters,
    lora_targets,
    watch_experts,
)

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def tiny_gpt_oss(seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    cfg = make_config("tiny-gpt-oss")
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    for m in model.modules():  # visible sinks and expert biases: the tests must see them matter
        if hasattr(m, "sinks"):
            torch.nn.init.normal_(m.sinks, std=1.0)
        if type(m).__name__ == "GptOssExperts":
            torch.nn.init.normal_(m.gate_up_proj_bias, std=0.1)
            torch.nn.init.normal_(m.down_proj_bias, std=0.1)
    return model


def with_lora(model, r=4, target="all-linear"):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, task_type="CAUSAL_LM",
                                            **lora_targets(model, target)))


def packed_steps(model, n, *, tokens=256, lr=1e-2):
    from jobs.training.models.synthetic import make_samples
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model, lr=lr)
    batches = list(packed_batches(make_samples("alpaca", tokens * (n + 2), vocab=256), tokens_per_step=tokens))
    return [train_step(model, b, opt, device="cpu") for b in batches[:n]]


# ---- targets -------------------------------------------------------------------------------------


def test_all_linear_on_gpt_oss_means_attention_and_every_expert_not_the_router():
    model = tiny_gpt_oss()
    t = lora_targets(model, "all-linear")
    assert sorted(t["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert t["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_model = with_lora(model)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert not any("router" in n for n in trainable)
    counts = expected_lora_parameters(model.config, 4)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == counts["total"]
    assert counts["experts"] == 2 * (4 * 4 * (64 + 128) + 4 * 4 * (64 + 64))


def test_named_mlp_projections_reach_the_fused_experts_and_dense_models_are_untouched(tiny_model):
    from transformers import AutoModelForCausalLM

    t = lora_targets(tiny_gpt_oss(), ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    assert t == {"target_modules": ["q_proj", "v_proj"],
                 "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    assert lora_targets(tiny_gpt_oss(), ["q_proj"]) == {"target_modules": ["q_proj"]}
    dense = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert lora_targets(dense, "all-linear") == {"target_modules": "all-linear"}


# ---- the expert check ----------------------------------------------------------------------------


def test_watch_counts_every_expert_tensor_with_gradient_and_moved():
    model = with_lora(tiny_gpt_oss())
    watch = ExpertLoraWatch(model)
    assert len(watch.tracked) == 8  # 2 layers x (gate_up, down) x (A, B)
    packed_steps(model, 5)
    assert watch.early_report is not None and watch.early_report.with_grad == 8  # checked on the 4th pass
    r = watch.finish()
    assert (r.tensors, r.with_grad, r.moved, r.not_judged, r.nonfinite, r.problems) == (8, 8, 8, 0, 0, [])
    assert r.expert_slices == 8 * 4 and r.slices_moved == 32
    assert 16 <= r.slices_with_grad <= 32  # an expert's lora_A slice waits for tokens after its lora_B moved
    assert r.parameters == expected_lora_parameters(model.config, 4)["experts"]


def test_a_new_adapters_lora_a_is_not_judged_on_its_first_step():
    """lora_B starts at zero, so lora_A's first gradient is exactly zero: a one-step night must not fail."""
    model = with_lora(tiny_gpt_oss())
    watch = ExpertLoraWatch(model)
    packed_steps(model, 1)
    r = watch.finish()
    assert r.problems == [] and r.not_judged == 4 and r.with_grad == 4 and r.moved == 4


def test_experts_that_get_no_gradient_fail_after_the_first_passes(monkeypatch):
    """The #606 failure: a forward that ignores the expert LoRA. Caught at the 4th pass, not at dawn."""
    from peft.tuners.lora.layer import ParamWrapper

    monkeypatch.setattr(ParamWrapper, "forward", lambda self, x, *a, **k: self.get_base_layer()(x, *a, **k))
    model = with_lora(tiny_gpt_oss())
    watch = ExpertLoraWatch(model)
    with pytest.raises(ExpertLoraError, match=r"4 of 8 expert LoRA tensors received no gradient on the first 3") as e:
        packed_steps(model, 6)
    assert "4 lora_A not judged" in str(e.value)  # their lora_B never moved: they cannot get one either
    assert e.value.report.with_grad == 0 and e.value.report.not_judged == 4 and watch.passes == 4
    report = ExpertLoraWatch(model, strict=False).finish()  # the bench's mode: reported, not raised
    assert report.problems and report.moved == 0


def test_nonfinite_expert_gradients_fail():
    model = with_lora(tiny_gpt_oss())
    watch = ExpertLoraWatch(model)
    for _, p, _ in [(t.name, t.param, 0) for t in watch.tracked][:1]:
        p.register_hook(lambda g: g * float("nan"))
    with pytest.raises(ExpertLoraError, match="NaN or infinite"):
        packed_steps(model, 2)
        watch.finish()


def test_a_moe_adapter_without_expert_lora_fails_before_training_when_experts_were_asked_for():
    model = with_lora(tiny_gpt_oss(), target=["q_proj", "v_proj"])
    with pytest.raises(ExpertLoraError, match="has no LoRA tensor in them"):
        watch_experts(model, "all-linear")
    assert watch_experts(model, ["q_proj", "v_proj"]) is None  # attention only, on purpose: fine


# ---- packed attention ------------------------------------------------------------------------------


def _segment_logits(model, ids, lengths):
    with torch.no_grad():
        alone = torch.cat([model(input_ids=c, use_cache=False).logits for c in torch.split(ids, lengths, 1)], 1)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return alone, packed


def test_gpt_oss_packed_rows_leak_across_samples_in_transformers_and_not_with_ours():
    from jobs.training.moe.lora import adapt_base

    model = tiny_gpt_oss().eval()
    ids = torch.randint(3, 250, (1, 40))
    lengths = [9, 20, 11]  # longer than the sliding window (8): the window is exercised too
    alone, leaky = _segment_logits(model, ids, lengths)
    assert (alone - leaky).abs().max() > 1e-2  # transformers 5.17: GPT-OSS masks ignore position_ids
    with torch.no_grad():
        eager_whole = model(input_ids=ids, use_cache=False).logits
    assert adapt_base(model)
    alone2, packed = _segment_logits(model, ids, lengths)
    torch.testing.assert_close(alone2, alone, rtol=1e-5, atol=1e-5)  # ours == eager on each sample
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(whole, eager_whole, rtol=1e-5, atol=1e-5)  # one long sample: the same as eager


class RefFlash:
    """Plain-torch stand-in for the aten varlen flash kernels (same arguments): (out, lse) forward and the
    flash backward formula dS = P (dP - rowsum(dO . O_given)), so the sink algebra is what is tested."""

    lse_3d = False

    @classmethod
    def _seg(cls, q, k, v, cu, i, scale, wl):
        a, b = int(cu[i]), int(cu[i + 1])
        rep = q.shape[1] // k.shape[1]
        qs, ks, vs = q[a:b], k[a:b].repeat_interleave(rep, 1), v[a:b].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        qi, ki = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        allowed = (ki <= qi) & ((ki >= qi - wl) if wl >= 0 else True)
        return a, b, rep, qs, ks, vs, s.masked_fill(~allowed, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, cu_q, cu_k, max_q, max_k, scale, wl, wr):
        outs, lses = [], []
        for i in range(len(cu_q) - 1):
            _, _, _, _, _, vs, s = cls._seg(q, k, v, cu_q, i, scale, wl)
            lse = torch.logsumexp(s, -1)
            outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vs))
            lses.append(lse)
        if cls.lse_3d:  # older kernels: (sequences, heads, max length), padded
            lse = torch.zeros(len(lses), q.shape[1], max_q, dtype=q.dtype)
            for i, x in enumerate(lses):
                lse[i, :, : x.shape[1]] = x
        else:
            lse = torch.cat(lses, 1)
        return torch.cat(outs), lse, None, None

    @classmethod
    def backward(cls, g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, seed, offset, scale, wl, wr):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i in range(len(cu_q) - 1):
            a, b, rep, qs, ks, vs, s = cls._seg(q, k, v, cu_q, i, scale, wl)
            row = lse[i, :, : b - a] if cls.lse_3d else lse[:, a:b]
            p = torch.exp(s - row[..., None])
            d = (g[a:b] * out[a:b]).sum(-1).t()  # (heads, L): the kernel's D from the `out` it is given
            ds = p * (torch.einsum("qhd,khd->hqk", g[a:b], vs) - d[..., None])
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
            dk[a:b] = (torch.einsum("hqk,qhd->khd", ds, qs) * scale).view(b - a, -1, rep, q.shape[-1]).sum(2)
            dv[a:b] = torch.einsum("hqk,qhd->khd", p, g[a:b]).view(b - a, -1, rep, q.shape[-1]).sum(2)
        return dq, dk, dv


def _eager_with_sinks(q, k, v, lengths, scale, window, sinks):
    """Truth: per sample, softmax over [keys, sink], (B=1, H, T, D) in, (1, T, H, D) out."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[:, :, start : start + n] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("bhqd,bhkd->bhqk", qs, ks) * scale
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
        s = s.masked_fill(~((ki <= qi) & (ki > qi - window)), float("-inf"))
        full = torch.cat([s, sinks.view(1, -1, 1, 1).expand(1, s.shape[1], n, 1)], -1)
        p = torch.softmax(full, -1)[..., :-1]
        outs.append(torch.einsum("bhqk,bhkd->bhqd", p, vs))
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


@pytest.mark.parametrize("lse_3d", [False, True])
def test_flash_sink_renormalisation_and_its_backward_equal_softmax_with_sinks(lse_3d):
    """The CUDA path's algebra on the CPU: out * sigmoid(lse - sink), and the flash backward fed dout * r and
    the renormalised output, give softmax-with-sinks attention and its exact gradients (sinks included)."""
    from jobs.training.moe.packed_attention import flash_attention, sdpa_attention, segments

    RefFlash.lse_3d = lse_3d
    lengths, h, kv, d, window = [3, 17, 9], 4, 2, 8, 5
    t = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, n, t, d, generator=g, dtype=torch.float64) for n in (h, kv, kv)]
    sinks0 = torch.randn(h, generator=g, dtype=torch.float64)
    weight = torch.randn(1, t, h, d, generator=g, dtype=torch.float64)
    results = []
    for fn in ("flash", "sdpa", "truth"):
        q, k, v = (x.clone().requires_grad_() for x in base)
        sinks = sinks0.clone().requires_grad_()
        seg = segments(pos, 1, t, t, "cpu")
        if fn == "flash":
            out = flash_attention(q, k, v, seg, d**-0.5, window, sinks, kernels=RefFlash)
        elif fn == "sdpa":
            out = sdpa_attention(q, k, v, seg, d**-0.5, window, sinks)
        else:
            out = _eager_with_sinks(q, k, v, lengths, d**-0.5, window, sinks)
        (out * weight).sum().backward()
        results.append([out, q.grad, k.grad, v.grad, sinks.grad])
    flash, sdpa, truth = results
    for name, a, b, c in zip(("out", "dq", "dk", "dv", "dsinks"), flash, sdpa, truth, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9, msg=f"flash {name}")
        torch.testing.assert_close(b, c, rtol=1e-9, atol=1e-9, msg=f"sdpa {name}")


def test_the_flash_self_check_passes_with_right_kernels_and_reports_missing_ones():
    from jobs.training.moe.packed_attention import self_check

    RefFlash.lse_3d = False
    assert self_check("cpu", torch.float32, kernels=RefFlash)["ok"]
    failed = self_check("cpu", torch.float32)  # no flash kernels on the CPU: the per-sample path will run
    assert not failed["ok"] and "_flash_attention_forward" in failed["error"]


# ---- grouped expert GEMMs ----------------------------------------------------------------------------


def _frozen_copy(model, quantize=False):
    from jobs.training.moe.experts_nf4 import DenseWeight, NF4Weight, replace_experts

    out = copy.deepcopy(model)
    for layer in out.model.layers:
        ex = layer.mlp.experts
        kind = NF4Weight.quantize if quantize else DenseWeight
        weights = {w: kind(getattr(ex, w).detach()) for w in ("gate_up_proj", "down_proj")}
        biases = {f"{w}_bias": getattr(ex, f"{w}_bias").detach() for w in ("gate_up_proj", "down_proj")}
        replace_experts(layer.mlp, "experts", ex, weights, biases)
    return out


def _same_lora(a, b):
    sa = {n: p for n, p in a.named_parameters() if p.requires_grad}
    sb = {n: p for n, p in b.named_parameters() if p.requires_grad}
    assert sa.keys() == sb.keys()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in sa:
            x = torch.randn(sa[n].shape, generator=g) * 0.1
            sa[n].copy_(x)
            sb[n].copy_(x)
    return sa, sb


def test_grouped_expert_lora_equals_peft_folding_it_into_the_weight():
    """Frozen experts + LoRA as grouped GEMMs (route_lora) == PEFT's ParamWrapper on dense experts."""
    from jobs.training.moe.experts_nf4 import route_lora

    dense = tiny_gpt_oss()
    frozen = _frozen_copy(dense)
    a, b = with_lora(dense), with_lora(frozen)
    assert route_lora(b) == 2 and route_lora(a) == 0
    sa, sb = _same_lora(a, b)
    ids = torch.randint(3, 250, (2, 24))
    oa, ob = (m(input_ids=ids, labels=ids, use_cache=False) for m in (a, b))
    torch.testing.assert_close(ob.logits, oa.logits, rtol=1e-5, atol=1e-5)
    oa.loss.backward()
    ob.loss.backward()
    for n in sa:
        torch.testing.assert_close(sb[n].grad, sa[n].grad, rtol=1e-4, atol=1e-6, msg=n)


@needs_bnb
def test_nf4_experts_compute_with_their_dequantised_weights():
    from jobs.training.moe.experts_nf4 import NF4Weight, route_lora

    dense = tiny_gpt_oss()
    nf4 = _frozen_copy(dense, quantize=True)
    for layer, ref in zip(nf4.model.layers, dense.model.layers, strict=True):  # the reference: dequantised
        for w in ("gate_up_proj", "down_proj"):
            q = layer.mlp.experts.frozen[w]
            assert isinstance(q, NF4Weight) and q.nbytes < getattr(ref.mlp.experts, w).numel()
            getattr(ref.mlp.experts, w).data.copy_(q.dequantize(torch.float32))
    a, b = with_lora(dense), with_lora(nf4)
    route_lora(b)
    _same_lora(a, b)
    ids = torch.randint(3, 250, (1, 30))
    torch.testing.assert_close(b(input_ids=ids, use_cache=False).logits, a(input_ids=ids, use_cache=False).logits,
                               rtol=1e-4, atol=1e-4)


# ---- the in-memory build, trained through our path ----------------------------------------------------


@pytest.mark.parametrize("quantize", [False, pytest.param(True, marks=needs_bnb)])
def test_in_memory_gpt_oss_trains_its_experts_and_saves_a_plain_peft_adapter(tmp_path, quantize):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jobs.training.moe.build import build_random_in_memory
    from jobs.training.moe.load import prepare_moe_for_training

    model, tok, info = build_random_in_memory("tiny-gpt-oss", device="cpu", quantize=quantize)
    assert info["quantized"] == ("nf4" if quantize else "none") and info["layers"] == 2
    loaded = prepare_moe_for_training(model, tok, r=4, alpha=8, build_info=info)
    i = loaded.info
    assert i["trainable_matches_expected"] and i["experts_routed_through_grouped_gemm"] == 2
    assert i["trainable_in_experts"] == i["expected_trainable"]["experts"] > 0
    watch = ExpertLoraWatch(loaded.model)
    stats = packed_steps(loaded.model, 4)
    assert all(math.isfinite(s.loss) for s in stats)
    r = watch.finish()
    assert (r.tensors, r.with_grad, r.moved, r.problems) == (8, 8, 8, [])
    loaded.model.save_pretrained(tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_config(make_config("tiny-gpt-oss"))  # a stock GptOssForCausalLM
    back = PeftModel.from_pretrained(plain, str(tmp_path / "adapter"))
    want = {n: p for n, p in loaded.model.named_parameters() if p.requires_grad and ".experts." in n}
    got = dict(back.named_parameters())
    assert want and all(torch.equal(got[n].float(), p.detach().float()) for n, p in want.items())
