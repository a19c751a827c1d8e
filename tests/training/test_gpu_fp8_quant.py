"""The Triton per-row quantisation against the reference on the card (issue 16): skipped without CUDA,
Triton or FP8 tensor cores.

python -m pytest tests/training/test_gpu_fp8_quant.py -q -m gpu
"""

from __future__ import annotations

import pytest

from tests.training.conftest import fp8_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = fp8_gpu_marks("triton")


def _inputs(rows: int, widths: list[int], seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ts = []
    for w in widths:
        t = torch.randn(rows, w + 8, device="cuda", dtype=torch.bfloat16, generator=g)[:, 4:4 + w]  # row stride != w
        ts.append(t * torch.logspace(-4, 4, rows, device="cuda")[:, None].to(torch.bfloat16))
    if rows > 2:
        for t in ts:
            t[1] = 0.0  # a padding row
    return ts


def assert_same_but_exact_ties(q, s, cat) -> None:
    """q, s against the reference's quantisation of `cat`: the same scales; the same e4m3 codes except where
    the exact quotient x / s lies on a rounding midpoint of the e4m3 grid (bf16 inputs often sit at simple
    ratios of their row's amax), where the last fp32 bit of the division decides and torch's division and
    Triton's differ. There, the two codes are the midpoint's neighbours."""
    from jobs.training.fp8.matmul import quant_rows_ref

    qr, sr = quant_rows_ref(cat)
    assert q.shape == qr.shape and q.is_contiguous() and torch.equal(s, sr)
    d = q.view(torch.uint8) != qr.view(torch.uint8)
    if not d.any():
        return
    exact = (cat.double() / sr.double())[d]
    a, b = q.double()[d], qr.double()[d]
    mid = (a + b) / 2
    assert ((exact - mid).abs() <= 1e-6 * mid.abs()).all(), "a difference away from a rounding midpoint"
    assert (torch.sign(a) == torch.sign(b)).all()
    assert int(d.sum()) <= max(2, d.numel() // 1000)


@pytest.mark.parametrize(("rows", "widths", "scaled"), [
    (1, [16], False), (37, [4096], False), (129, [14336], False), (64, [5000], False), (33, [8192], False),
    (53, [4096, 1024, 1024], True), (19, [14336, 14336], True), (7, [4096], True), (0, [64], False),
])
def test_the_kernel_matches_the_reference_up_to_exact_ties(rows, widths, scaled):
    from jobs.training.fp8.quant_kernel import quant_rows

    ts = _inputs(rows, widths, seed=rows)
    g = torch.Generator(device="cuda").manual_seed(1)
    ss = [torch.rand(1, w, device="cuda", generator=g) * 1e-3 for w in widths] if scaled else None
    q, s = quant_rows(ts, ss)
    cat = torch.cat([t.float() * c for t, c in zip(ts, ss, strict=True)], 1) if ss else torch.cat(ts, 1)
    assert q.shape == (rows, sum(widths)) and s.shape == (rows, 1)
    assert_same_but_exact_ties(q, s, cat)


def test_off_the_grid_quotients_round_once_to_nearest_even():
    """Triton casts fp32 to e4m3 through fp16: 167.99 -> 168 -> 176 where nearest is 160. The kernel
    rounds on the e4m3 grid first, so values off a midpoint go to their nearest neighbour (the row's
    amax is 448: the scale is 1 within an fp32 ulp, far from moving these values across a midpoint)."""
    from jobs.training.fp8.quant_kernel import quant_rows

    row = torch.tensor([[448.0, 167.99, -167.99, 168.01, 0.0029296, -0.0029296, 1e-4, -1e-4]], device="cuda")
    q, s = quant_rows([torch.nn.functional.pad(row, (0, 8))])
    assert abs(s.item() - 1.0) < 1e-6
    assert q.float()[0, :8].tolist() == [448.0, 160.0, -160.0, 176.0, 0.001953125, -0.001953125, 0.0, -0.0]
    assert q.view(torch.uint8)[0, 7].item() == 0x80  # -0.0 keeps its sign, as torch's cast does


def test_the_product_path_uses_the_kernel_and_counts_no_fallback():
    from jobs.training.fp8.matmul import STATS, quant_scaled, quant_x

    x = torch.randn(100, 4096, device="cuda", dtype=torch.bfloat16)
    assert_same_but_exact_ties(*quant_x(x), x)
    dy = [torch.randn(100, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    sc = [torch.rand(1, 1024, device="cuda") for _ in range(2)]
    cat = torch.cat([d.float() * c for d, c in zip(dy, sc, strict=True)], 1)
    assert_same_but_exact_ties(*quant_scaled(dy, sc), cat)
    assert "quant_rows" not in STATS.compile_fallbacks
