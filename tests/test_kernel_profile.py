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
    # our own Triton kernels (features/, engine/), by their function's name
    ("partial_sums_kernel", "matmul"),
    ("write_rows_kernel", "cache write"),
    ("rope_kernel", "rope"),
    ("swiglu_quantize_kernel", "elementwise"),
    ("row_stats_kernel", "sampling"),
    ("merge_kernel", "attention"),
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
    assert sum(p["kernel_seconds"].values()) == pytest.approx(busy)  # every kernel, by name
    assert sum(p["seconds"].values()) == pytest.approx(p["wall_seconds"], rel=1e-6)
    # One stream: its kernels and the idle gaps between them fill the span from first to last
    idle = p["idle"]
    assert busy + idle["idle_seconds"] == pytest.approx(idle["span_seconds"], rel=1e-3)
    assert idle["span_seconds"] <= p["wall_seconds"]


def test_idle_gaps_are_the_spans_between_busy_stretches_of_overlapping_kernels():
    # (start, end, name) in microseconds, out of order; b runs inside a (two streams), so the
    # first gap is after a, which ends last, not after b
    kernels = [(30, 35, "c"), (0, 20, "a"), (5, 10, "b"), (60, 61, "d"), (36, 40, "e")]
    idle = kernel_profile.idle_gaps(kernels)
    assert idle["span_seconds"] == pytest.approx(61e-6)
    assert idle["idle_seconds"] == pytest.approx((10 + 1 + 20) * 1e-6)
    assert idle["largest"] == [
        {"us": 20, "after": "e", "before": "d", "at_ms": 0.040},
        {"us": 10, "after": "a", "before": "c", "at_ms": 0.020},
        {"us": 1, "after": "c", "before": "e", "at_ms": 0.035}]
    many = [(10 * i, 10 * i + 1, f"k{i}") for i in range(kernel_profile.GAPS_KEPT + 5)]
    assert len(kernel_profile.idle_gaps(many)["largest"]) == kernel_profile.GAPS_KEPT


def test_gaps_prints_each_runs_idle_time_and_its_largest_gaps(tmp_path, capsys):
    idle = {"span_seconds": 0.080, "idle_seconds": 0.012,
            "largest": [{"us": 9000.0, "after": "nvjet_gemm", "before": "rope_kernel",
                         "at_ms": 41.5}]}
    run = fake_profile({"nvjet_gemm": 0.068}) | {"wall_seconds": 0.1, "idle": idle}
    path = tmp_path / "ours.json"
    path.write_text(json.dumps({"engine": "ours", "profile": {
        "requests": 1, "prompt_tokens": 2, "decoded_tokens": 0, "prefill": run,
        "whole": fake_profile({"nvjet_gemm": 0.068}),  # as written before --gaps
        "decode_seconds_per_token": dict.fromkeys(kernel_profile.CLASS_ORDER, 0.0)}}))
    kernel_profile.main([str(path), "--gaps"])
    out = capsys.readouterr().out
    assert ("ours, prefill run: wall 100.0 ms; before the first kernel and after the last 20.0 ms;"
            " idle between kernels 12.0 ms" in out)
    assert [line.split() for line in out.splitlines() if line.startswith("  ")][-1] == [
        "9.00", "ms", "at", "41.5", "ms", "after", "nvjet_gemm", "before", "rope_kernel"]
    assert "ours, whole: no idle gaps in this profile" in out


def fake_profile(kernel_seconds: dict) -> dict:
    seconds = dict.fromkeys(kernel_profile.CLASS_ORDER, 0.0)
    for name, s in kernel_seconds.items():
        seconds[kernel_profile.kernel_class(name)] += s
    return {"seconds": seconds, "wall_seconds": sum(seconds.values()), "kernel_seconds": kernel_seconds}


def test_a_kernels_decode_time_is_the_whole_runs_less_the_prefill_runs_per_decoded_token(monkeypatch):
    runs = iter([fake_profile({"nvjet_gemm": 0.5, "store_kvcache_kernel": 0.1}),  # prefill only
                 fake_profile({"nvjet_gemm": 0.9, "store_kvcache_kernel": 0.3, "argmax": 0.02})])
    monkeypatch.setattr(kernel_profile, "profile_seconds", lambda run: next(runs))
    p = kernel_profile.profile_engine(lambda prompts, budgets: None, [[1, 2]] * 4, [11] * 4)
    assert p["decoded_tokens"] == 4 * 10  # the first token of each came from prefill
    per_token = p["decode_kernel_seconds_per_token"]
    assert per_token["nvjet_gemm"] == pytest.approx(0.4 / 40)
    assert per_token["store_kvcache_kernel"] == pytest.approx(0.2 / 40)
    assert per_token["argmax"] == pytest.approx(0.02 / 40)
    assert p["decode_seconds_per_token"]["matmul"] == pytest.approx(0.4 / 40)


def test_kernels_lists_each_profiles_largest_kernels_first(tmp_path, capsys, monkeypatch):
    runs = iter([fake_profile({"nvjet_gemm": 0.5, "flash_fwd_splitkv_kernel": 0.05}),
                 fake_profile({"nvjet_gemm": 0.9, "flash_fwd_splitkv_kernel": 0.25,
                               "index_copy_kernel_impl": 0.01})])
    monkeypatch.setattr(kernel_profile, "profile_seconds", lambda run: next(runs))
    ours = {"engine": "ours", "profile": kernel_profile.profile_engine(
        lambda prompts, budgets: None, [[1, 2]] * 4, [11] * 4)}
    old = {"engine": "old", "profile": {k: v for k, v in ours["profile"].items()
                                        if k != "decode_kernel_seconds_per_token"}}
    paths = []
    for record in (ours, old):
        paths.append(tmp_path / f"{record['engine']}.json")
        paths[-1].write_text(json.dumps(record))
    kernel_profile.main([str(p) for p in paths] + ["--kernels", "2"])
    out = capsys.readouterr().out.splitlines()
    decode = [line.split() for line in out if line.startswith("  decode")]
    assert decode == [["decode", "10,000.00", "matmul", "nvjet_gemm"],  # 0.4 s over 40 tokens
                      ["decode", "5,000.00", "attention", "flash_fwd_splitkv_kernel"]]
    prefill = [line.split() for line in out if line.startswith("  prefill")]
    assert [(row[1], row[3]) for row in prefill] == [("500.00", "nvjet_gemm"),
                                                      ("50.00", "flash_fwd_splitkv_kernel")]
    assert any("old: no kernel names" in line for line in out)


def test_the_table_sets_the_floor_of_the_same_requests_beside_them(tmp_path, capsys, monkeypatch):
    runs = iter([fake_profile({"nvjet_gemm": 0.5}), fake_profile({"nvjet_gemm": 0.9})])
    monkeypatch.setattr(kernel_profile, "profile_seconds", lambda run: next(runs))
    asked = []

    def floor(prompts, budgets):  # as tools/bench.py's profile_floor: the runs' own requests
        asked.append(budgets)
        return {"prefill_seconds": {"matmul": 0.25, "attention": 0.05},
                "decode_seconds_per_token": {"matmul": 0.004, "attention": 0.001}}
    record = {"engine": "ours", "profile": kernel_profile.profile_engine(
        lambda prompts, budgets: None, [[1, 2]] * 4, [100] * 4, floor)}
    assert asked == [[kernel_profile.PROFILE_NEW_TOKENS] * 4]  # what the profiled run drew
    path = tmp_path / "ours.json"
    path.write_text(json.dumps(record))
    kernel_profile.main([str(path)])
    rows = {line[:24].strip(): line[24:].split() for line in capsys.readouterr().out.splitlines()}
    # ours, then the floor: prefill in ms, decode in us per decoded token
    assert rows["matmul"][1] == "250.0" and rows["matmul"][3] == "4,000.00"
    assert rows["attention"][1] == "50.0" and rows["attention"][3] == "1,000.00"
    assert rows["gaps"][1] == "0.0" and rows["gaps"][3] == "0.00"
    assert rows["all (wall)"][1] == "300.0" and rows["all (wall)"][3] == "5,000.00"


def test_a_profile_written_before_a_kernel_was_named_shows_it_in_its_class_now(tmp_path,
                                                                               monkeypatch):
    runs = iter([fake_profile({"nvjet_gemm": 0.5}),  # prefill only: cuBLAS
                 fake_profile({"nvjet_gemm": 0.9, "partial_sums_kernel": 0.2})])  # + split-K
    monkeypatch.setattr(kernel_profile, "profile_seconds", lambda run: next(runs))
    profile = kernel_profile.profile_engine(lambda prompts, budgets: None, [[1, 2]] * 4, [11] * 4)
    # As a profile written before partial_sums was in KERNEL_CLASSES stored it: under "other"
    profile["whole"]["seconds"] |= {"matmul": 0.9, "other": 0.2}
    profile["decode_seconds_per_token"] |= {"matmul": 0.4 / 40, "other": 0.2 / 40}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"engine": "old", "profile": profile}))
    decode = kernel_profile.profile_json(str(path))["profile"]["decode_seconds_per_token"]
    assert decode["matmul"] == pytest.approx((0.4 + 0.2) / 40)  # cuBLAS's and split-K's
    assert decode["other"] == 0.0
