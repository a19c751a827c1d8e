"""The frozen base on FP8 (e4m3) tensor cores, `[train] compute = "fp8"`: the matmuls and their kernels,
the conversion of a loaded model, the numerics check that gates it, and the LoRA Functions over it."""
