"""tools/kernel_profile.py: kernels put in the class their name says, and the table's inputs."""

import json

import pytest
import torch

from tools import kernel_profile


@pytest.mark.parametrize("name, expected", [
    # names as the profiler reports them, from flash-attn, cuBLAS/CUTLASS, inductor, nano-vllm
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
    ("_paged_decode_kernel", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "matmul"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused (torch.compile)"),
    ("store_kvcache_kernel", "cache write"),
    ("void at::native::index_copy_kernel_impl<OpaqueType<2>>", "cache write"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampling"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "collectives (NCCL)"),  # "reduce" would make it elementwise: the collectives match first
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives (NCCL)"),
    ("some_kernel_nobody_named", "other"),
])
def test_kernels_fall_in_the_class_their_names_say(name, expected):
    assert kernel_profile.kernel_class(name) == expected


def test_the_table_refuses_a_json_that_is_no_profile(tmp_path, capsys):
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"output_tokens_per_second": 1.0}))
    with pytest.raises(SystemExit) as ended:
        kernel_profile.main([str(bad)])
    assert ended.value.code == 2 and "is no --profile JSON" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels")
def test_a_matmul_loop_is_counted_as_matmuls_and_the_classes_add_up_to_the_wall():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def matmuls():
        for _ in range(20):
            a @ a
    matmuls()
    p = kernel_profile.profile_seconds(matmuls)
    busy = sum(p["seconds"].values()) - p["seconds"]["gaps"]
    assert p["seconds"]["matmul"] > 0.9 * busy
    assert sum(p["seconds"].values()) == pytest.approx(p["wall_seconds"], rel=1e-6)
