"""GPU checks of FP8 bases kept in NF4 (issue 16): bitsandbytes' own 4-bit layers read by the Triton kernel into exactly
the e4m3 values of an e4m3 copy, forward and transposed; the Functions on NF4 bases at the 8B's and 32B's shapes.

python -m pytest tests/training/test_gpu_fp8_nf4.py -q -m gpu
"""

from __future__ import annotations

import pytest

from tests.training.conftest import fp8_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = fp8_gpu_marks("bitsandbytes")


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1024, 4096), (25600, 5120), (5120, 25600), (48, 80)])
def test_a_linear4bit_converts_to_the_e4m3_copys_very_bytes(n, k, nested):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    from jobs.training.fp8.matmul import STATS, FP8Base, FP8Group, transpose_cat
    from jobs.training.fp8.nf4 import NF4Source

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=nested)
    data = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    layer.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=nested)
    layer = layer.cuda()
    src = NF4Source.from_params4bit(layer.weight)
    assert src is not None and src.nested == nested
    dense = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)  # what the bf16 path multiplies with
    assert dense.dtype == torch.bfloat16
    assert torch.equal(src.dequantized(), dense)
    copy = FP8Base.from_weight(dense)
    kept = FP8Base.from_nf4(src, dense)
    assert torch.equal(kept.weight_scale, copy.weight_scale)
    assert torch.equal(kept.fp8_weight().view(torch.uint8), copy.weight.view(torch.uint8))
    assert torch.equal(FP8Group([kept], keep_transposed=False).transposed().view(torch.uint8),
                       transpose_cat([copy.weight]).view(torch.uint8))
    assert "nf4_to_fp8" not in STATS.compile_fallbacks


@pytest.mark.parametrize(("kind", "shapes"), [
    ("qkv", [(8192, 5120), (1024, 5120), (1024, 5120)]),
    ("mlp", [(14336, 4096), (14336, 4096), (4096, 14336)]),
    ("linear", [(1024, 4096)]),
])
def test_the_functions_on_nf4_bases_match_fp32_on_the_card(kind, shapes):
    pytest.importorskip("unsloth")
    from unsloth.kernels.swiglu import swiglu_DWf_DW_dfg_kernel, swiglu_fg_kernel

    from jobs.training.fp8.nf4 import bnb_nf4
    from jobs.training.fp8.selftest import check_kind, verdict

    sw = (swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel) if kind == "mlp" else None
    err = check_kind(kind, shapes, tokens=1000, swiglu=sw, nf4=bnb_nf4)
    assert verdict(kind, err) is None, err
    assert 0.005 < err["out0"] < 0.06 and 0.005 < err["dx"] < 0.06
