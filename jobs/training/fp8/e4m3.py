"""The e4m3 format's constants, shared by the FP8 path (jobs/training/fp8/matmul.py) and its Triton
quantisation kernel (jobs/training/fp8/quant_kernel.py)."""

import torch

E4M3 = torch.float8_e4m3fn
FMAX = 448.0  # largest finite e4m3fn
# An all-zero row (padding) gets this instead of a zero scale. Far below any real row, so that tiny
# rows (dy * s_w in the backward: gradients times weight scales of ~1e-4) keep their own scale.
MIN_AMAX = 1e-30
ALIGN = 16  # the FP8 GEMM needs K and N divisible by 16 (M is free)
