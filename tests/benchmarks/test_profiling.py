"""Kernel names from real H100/H200 profiles, sorted into the parts of a step the README reports."""

from benchmarks.profiling import by_category, kernel_category


def test_kernel_names_from_real_profiles_fall_into_their_parts():
    assert kernel_category("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_ovscale_TNT") == "fp8 gemm"
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_category("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>(...)") == "gemm"
    assert kernel_category("flash_fwd_kernel") == "attention"
    assert kernel_category("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, ...)") == "nf4 dequant"
    assert kernel_category("triton_red_fused__to_copy_abs_amax_cat_mul_0") == "quantise (amax, scale)"
    assert kernel_category("triton_poi_fused__to_copy_cat_clamp_div_mul_2") == "quantise (amax, scale)"
    assert kernel_category("_rms_layernorm_forward") == "norm/rope/activation"
    assert kernel_category("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>") == "copy/cast"
    assert kernel_category("_cross_entropy_forward") == "cross entropy"
    assert kernel_category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert kernel_category("void some_unknown_kernel<float>()") == "other"


def test_categories_sum_the_device_time_largest_first():
    cats = by_category([("flash_fwd_kernel", 3000.0), ("nvjet_sm90_tst_x", 5000.0), ("flash_bwd_kernel", 2000.0)])
    assert cats == [{"category": "attention", "ms": 5.0, "share": 0.5}, {"category": "gemm", "ms": 5.0, "share": 0.5}]
    assert by_category([]) == []


def test_idle_gaps_are_the_stretches_between_kernels_with_their_neighbours():
    from benchmarks.profiling import idle_gaps

    ks = [("a", 0.0, 10.0), ("b", 5.0, 30.0), ("c", 100.0, 110.0), ("d", 115.0, 120.0), ("e", 300.0, 301.0)]
    g = idle_gaps(ks, min_us=20.0)
    assert g["count"] == 2 and g["ms"] == 0.25  # 70 us after b, 180 us after d; the 5 us one is below the floor
    assert [(x["us"], x["after"], x["before"]) for x in g["longest"]] == [(180.0, "d", "e"), (70.0, "b", "c")]
