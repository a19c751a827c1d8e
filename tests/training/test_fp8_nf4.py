"""FP8 bases kept in NF4 (issue 16's storage choice), CPU side: bitsandbytes' layout read right, the e4m3 values
exactly those of an e4m3 copy (forward and transposed), the Functions unchanged by the storage, the conversion's
switch and its memory accounting, the config key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jobs.training.config import TrainConfig
from jobs.training.fp8 import E4M3, FP8Base, FP8Group, transpose_cat
from jobs.training.fp8_nf4 import NF4Source
from jobs.training.fp8_selftest import check_kind, verdict

# bitsandbytes' NF4 code (functional.get_4bit_type("nf4"))
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def quantize_nf4(w: torch.Tensor, blocksize: int = 64, nested: bool = False):
    """A test quantiser writing bitsandbytes' layout: (NF4Source, the codes [N*K], the fp32 absmax a block)."""
    flat = w.float().reshape(-1)
    absmax = flat.view(-1, blocksize).abs().amax(1).clamp(min=1e-12)
    normed = (flat.view(-1, blocksize) / absmax[:, None]).reshape(-1)
    idx = (normed[:, None] - NF4[None, :]).abs().argmin(1).to(torch.uint8)
    packed = ((idx[0::2] << 4) | idx[1::2]).view(-1, 1)  # the even-indexed value in the high nibble
    if not nested:
        return NF4Source(packed, absmax, NF4, blocksize, tuple(w.shape)), idx, absmax
    offset = float(absmax.mean())
    centred = absmax - offset
    code2, b2 = torch.linspace(-1, 1, 256), 256
    padded = torch.cat([centred, centred.new_zeros((-centred.numel()) % b2)]).view(-1, b2)
    absmax2 = padded.abs().amax(1).clamp(min=1e-12)
    q = ((padded / absmax2[:, None]).reshape(-1)[: centred.numel(), None] - code2[None, :]).abs().argmin(1)
    q = q.to(torch.uint8)
    used = code2[q.long()] * absmax2.repeat_interleave(b2)[: q.numel()] + offset
    return NF4Source(packed, q, NF4, blocksize, tuple(w.shape), (absmax2, code2, b2, offset)), idx, used


@pytest.mark.parametrize("nested", [False, True])
def test_the_packed_bytes_are_read_as_bitsandbytes_writes_them(nested):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.02
    src, idx, absmax = quantize_nf4(w, nested=nested)
    want = (NF4[idx.long()] * absmax.repeat_interleave(64)).to(torch.bfloat16).view(48, 128)
    assert torch.equal(src.dequantized(), want)
    assert torch.equal(src.absmax_f32(), absmax)
    assert (src.dequantized().float() - w).norm() / w.norm() < 0.12  # NF4's own error: the layout is right


@pytest.mark.parametrize("nested", [False, True])
def test_an_nf4_base_gives_exactly_the_e4m3_copys_values_forward_and_transposed(nested):
    torch.manual_seed(1)
    srcs = [quantize_nf4(torch.randn(n, 64) * 0.02, nested=nested)[0] for n in (64, 32, 32)]
    dense = [s.dequantized() for s in srcs]
    copies = [FP8Base.from_weight(d) for d in dense]
    kept = [FP8Base.from_nf4(s, d) for s, d in zip(srcs, dense, strict=True)]
    for c, k in zip(copies, kept, strict=True):
        assert k.weight is None and k.nf4 is not None
        assert torch.equal(k.weight_scale, c.weight_scale)
        assert torch.equal(k.fp8_weight().view(torch.uint8), c.weight.view(torch.uint8))
    want = transpose_cat([c.weight for c in copies]).view(torch.uint8)
    assert torch.equal(FP8Group(kept, keep_transposed=False).transposed().view(torch.uint8), want)
    mixed = FP8Group([copies[0], kept[1], copies[2]], keep_transposed=True)  # per base, into its columns
    assert mixed.weight_t is not None and mixed.weight_t.dtype == E4M3
    assert torch.equal(mixed.transposed().view(torch.uint8), want)


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(64, 64), (32, 64), (32, 64)]),
    ("o", [(64, 128)]),
    ("mlp", [(128, 64), (128, 64), (64, 128)]),
    ("linear", [(48, 64)]),
])
def test_the_functions_on_nf4_bases_compute_what_they_do_on_e4m3_copies(kind, shapes, monkeypatch):
    def quantiser(w):
        src, _, _ = quantize_nf4(w.cpu())
        return src, src.dequantized()

    kept = check_kind(kind, shapes, device="cpu", tokens=48, nf4=quantiser)
    assert verdict(kind, kept) is None, kept
    assert kept["dx"] > 0.005  # FP8 ran
    monkeypatch.setattr(FP8Base, "from_nf4", classmethod(lambda cls, src, w, bias=None: cls.from_weight(w, bias)))
    assert check_kind(kind, shapes, device="cpu", tokens=48, nf4=quantiser) == kept  # the same weights as copies


def test_the_conversion_keeps_nf4_bases_in_nf4_and_accounts_for_them(monkeypatch):
    from jobs.training import fp8_convert
    from jobs.training.fp8_convert import Conversion, Unit, base_bytes

    torch.manual_seed(2)
    srcs = {}

    class Nf4Linear(torch.nn.Linear):  # a Linear4bit's shape: packed bytes with a quant_state on the weight
        def __init__(self, n, k):
            super().__init__(k, n, bias=False)
            src, _, _ = quantize_nf4(torch.randn(n, k) * 0.02, nested=True)
            weight = torch.nn.Parameter(src.packed.view(-1, 1), requires_grad=False)
            state2 = SimpleNamespace(absmax=src.absmax2, code=src.code2, blocksize=256)
            weight.quant_state = SimpleNamespace(quant_type="nf4", shape=torch.Size([n, k]), absmax=src.absmax,
                                                 code=src.code, blocksize=64, nested=True, offset=src.offset,
                                                 dtype=torch.bfloat16, state2=state2)
            self.weight = weight
            srcs[id(self)] = src

    def dense(base):  # bitsandbytes' dequantisation, here from the test's own source
        return srcs[id(base)].dequantized(), True, ""

    monkeypatch.setattr(fp8_convert, "dense_weight", dense)

    def model():
        m = torch.nn.Module()
        m.o_proj = Nf4Linear(1024, 1024)  # big enough to show in GB to 3 decimals
        return m

    for storage, held, other in (("nf4", "fp8_nf4_gb", "fp8_gb"), ("fp8", "fp8_gb", "fp8_nf4_gb")):
        m = model()
        original = m.o_proj
        unit = Unit("frozen", m, {"linear": ("o_proj", fp8_convert.ModuleSlot(m, "o_proj"))}, "modules")
        conv = Conversion(storage=storage).run([unit])
        base = m.o_proj
        assert conv.converted == 1 and isinstance(base, FP8Base)
        assert (base.nf4 is not None) == (storage == "nf4")
        if storage == "nf4":  # the very bytes the 4-bit layer held, not a copy
            assert base.nf4.packed.data_ptr() == original.weight.data_ptr()
        copy = FP8Base.from_weight(srcs[id(original)].dequantized())
        assert torch.equal(base.fp8_weight().view(torch.uint8), copy.weight.view(torch.uint8))
        sizes = base_bytes(m)
        assert sizes[held] > 0 and sizes[other] == 0


def test_an_nf4_source_refuses_data_that_does_not_cover_its_weight():
    src, _, _ = quantize_nf4(torch.randn(16, 64))
    with pytest.raises(ValueError, match="holds 1024 values, the weight 32x64"):
        NF4Source(src.packed, src.absmax, NF4, 64, (32, 64))
    with pytest.raises(ValueError, match="absmax blocks"):
        NF4Source(src.packed, src.absmax[:4], NF4, 64, (16, 64))


def test_storage_is_a_config_key_an_e4m3_copy_by_default_and_contradictions_are_named(tmp_path):
    from jobs.night.config import NightConfig
    from jobs.night.model import throughput_key

    assert TrainConfig().fp8_storage == "fp8"
    cfg = NightConfig.model_validate({"state_dir": tmp_path, "model": {"path": tmp_path}})
    nf4 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8_storage": "nf4"})})
    assert throughput_key(cfg, "m", "unsloth", "H200") != throughput_key(nf4, "m", "unsloth", "H200")
    with pytest.raises(ValueError, match=r"fp8_storage.*fp8_keep_transposed"):
        TrainConfig(fp8_storage="nf4", fp8_keep_transposed=True)
    with pytest.raises(ValueError, match="fp8_storage"):
        TrainConfig(fp8_storage="int4")


def test_calibrate_names_nf4_storage_only_where_fp8_runs_as_a_copy_of_a_4bit_base():
    from jobs.night.calibrate import nothing_fits
    from jobs.training.compute import CalibrationDecision

    fp8, bf16 = CalibrationDecision("fp8", None), CalibrationDecision("bf16", None)
    msg = nothing_fits(40.0, TrainConfig(), fp8)
    assert "nothing fits under 40.0 GB" in msg and 'fp8_storage = "nf4"' in msg
    for t, d in ((TrainConfig(), bf16), (TrainConfig(), None), (TrainConfig(fp8_storage="nf4"), fp8),
                 (TrainConfig(method="lora"), fp8)):
        assert "fp8_storage" not in nothing_fits(40.0, t, d)
