"""A frozen base kept in NF4 and dequantised straight to FP8 at each use (`[train] fp8_storage = "nf4"`, issue 16).

An e4m3 copy of the base costs 1 byte a parameter against NF4's ~0.52 (Qwen3-32B's 31.2 GB against 16.1). Kept in
NF4, the base leaves that memory to the step; the price is one pass over the packed bytes per use (the forward
reads [N, K], the input gradient the transposed [K, N], written so by the same kernel: no separate transpose; the
kernel, jobs/training/fp8/nf4_kernel.py, moves ~1,300-1,600 GB/s). Measured on H200s: under `max_vram_gb = 56` the
copy leaves no room for a 2,048-token step and NF4 storage trains FP8 at 3,993 tok/s against bf16 QLoRA's 3,803
(RESULTS.md: 2026-11-26, NF4 storage v2; an earlier kernel); under 72 GB its 3,584-token steps ran 5,031 / 5,055 tok/s
against the copy's 2,304-token 4,844 / 4,294 (RESULTS.md: 2026-11-26, 32B NF4 vs copy calibrate). Which one a run uses:
`choose_storage` in jobs/training/fp8/convert.py.

The values are exactly those of the e4m3 copy: bitsandbytes' dequantisation (code[nibble] * absmax in fp32, rounded
to bf16; a nested absmax is code2[byte] * absmax2[block] + offset, in fp32) divided by the per-output-channel scale
taken once from the dequantised weight, rounded once to e4m3 — `quant_rows_ref` of the bf16 weight. The layout is
bitsandbytes' Params4bit: the [N, K] weight flattened row-major, two values a byte, the even-indexed one in the high
nibble, one absmax per `blocksize` values.
"""

from __future__ import annotations

from typing import Any

import torch

from jobs.training.fp8.e4m3 import E4M3, FMAX, MIN_AMAX


class NF4Source(torch.nn.Module):
    """One frozen [N, K] weight as bitsandbytes stores it in 4 bits (the tensors are shared, not copied); buffers, so
    that `.to()` moves them and memory accounting sees them."""

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                 shape: tuple[int, int], nested: tuple[torch.Tensor, torch.Tensor, int, float] | None = None) -> None:
        super().__init__()
        n, k = shape
        self.shape = (int(n), int(k))
        if packed.numel() * 2 != n * k:
            raise ValueError(f"NF4 data holds {packed.numel() * 2} values, the weight {n}x{k}")
        if absmax.numel() * blocksize < n * k:
            raise ValueError(f"{absmax.numel()} absmax blocks of {blocksize} do not cover {n}x{k}")
        self.blocksize = int(blocksize)
        self.register_buffer("packed", packed.reshape(-1), persistent=False)
        self.register_buffer("absmax", absmax.reshape(-1), persistent=False)
        self.register_buffer("code", code.float().reshape(-1), persistent=False)
        self.nested = nested is not None
        if nested is not None:  # the absmax itself 8-bit: code2[byte] * absmax2[block of blocksize2] + offset
            absmax2, code2, self.blocksize2, self.offset = nested[0], nested[1], int(nested[2]), float(nested[3])
            self.register_buffer("absmax2", absmax2.float().reshape(-1), persistent=False)
            self.register_buffer("code2", code2.float().reshape(-1), persistent=False)
        elif absmax.dtype != torch.float32:
            raise ValueError(f"a plain absmax must be fp32, got {absmax.dtype}")

    @classmethod
    def from_params4bit(cls, weight: Any) -> NF4Source | None:
        """From a bitsandbytes Params4bit with its quant_state (NF4 dequantising to bf16, as a bf16 model's layers
        do); None for anything else (that base gets its e4m3 copy)."""
        if not kept_in_nf4(weight):
            return None
        qs = weight.quant_state
        nested = None
        if getattr(qs, "nested", False):
            s2 = qs.state2
            nested = (s2.absmax, s2.code, s2.blocksize, float(qs.offset))
        return cls(weight.data, qs.absmax, qs.code, qs.blocksize, (int(qs.shape[0]), int(qs.shape[1])), nested)

    def absmax_f32(self) -> torch.Tensor:
        """One fp32 absmax per block, as bitsandbytes dequantises a nested one."""
        if not self.nested:
            return self.absmax
        blocks2 = torch.arange(self.absmax.numel(), device=self.absmax.device) // self.blocksize2
        return self.code2[self.absmax.long()] * self.absmax2[blocks2] + self.offset

    def dequantized(self) -> torch.Tensor:
        """The bf16 [N, K] weight bitsandbytes' dequantize_4bit gives."""
        nib = torch.stack([self.packed >> 4, self.packed & 15], dim=1).reshape(-1).long()
        n, k = self.shape
        absmax = self.absmax_f32().repeat_interleave(self.blocksize)[: n * k]
        return (self.code[nib] * absmax).to(torch.bfloat16).view(n, k)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, blocksize={self.blocksize}, nested={self.nested}"


def kept_in_nf4(weight: Any) -> bool:
    """Whether NF4 storage can keep this weight as it is: a bitsandbytes NF4 [N, K] dequantising to bf16."""
    qs = getattr(weight, "quant_state", None)
    return (qs is not None and getattr(qs, "quant_type", None) == "nf4" and len(qs.shape) == 2
            and getattr(qs, "dtype", torch.bfloat16) == torch.bfloat16)


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel dequant scales [N, 1] of a weight [N, K], as `quant_rows_ref` takes them."""
    return w.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FMAX


def nf4_to_fp8_ref(src: NF4Source, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The e4m3 weight [N, K] (or its transpose: `out` may be any [N, K] view, e.g. `t.t()` of a column slice of
    [K, sum N]) from NF4, divided by `scale` [N, 1]: in torch (CPU, tests, the kernel's fall-back)."""
    w = src.dequantized().float()
    out.copy_((w / scale.view(-1, 1)).clamp(-FMAX, FMAX).to(E4M3))
    return out


def bnb_nf4(w: torch.Tensor) -> tuple[NF4Source, torch.Tensor]:
    """`w` quantised by bitsandbytes as a Linear4bit holds it (NF4, nested absmax, blocks of 64), and the bf16 weight
    bitsandbytes dequantises it to: for the self-test of NF4-stored bases on the card."""
    import bitsandbytes.functional as bnbf

    packed, qs = bnbf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, compress_statistics=True, quant_type="nf4")
    nested = (qs.state2.absmax, qs.state2.code, qs.state2.blocksize, float(qs.offset)) if qs.nested else None
    src = NF4Source(packed, qs.absmax, qs.code, qs.blocksize, (int(w.shape[0]), int(w.shape[1])), nested)
    return src, bnbf.dequantize_4bit(packed, qs)
