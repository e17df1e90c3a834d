"""bench.py's arithmetic against PyTorch's own FLOP counter."""

import os
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llama3_paged import TorchAttention
from tools.bench import (gpu_wait_seconds_per_step, parse_arguments, prefill_flops,
                         script_arguments, weight_bytes_read_per_step)
from plumbing.inputs import random_model
from tools.shared import ClockSampler, clock_line
from llama3_paged import Llama
from engine.attention_metadata import AttentionMetadata, Phase
from llama3_paged import KVCache, PrefillBatch


def test_prefill_flops_match_pytorchs_count():
    # One-token prompts: causal attention is then the full attention that the counter counts.
    model = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=0)
    n = 5
    cache = KVCache(model.args, 1, n, torch.float32, "cpu", TorchAttention())
    bounds = list(range(n + 1))
    batch = PrefillBatch(torch.arange(n), torch.tensor(bounds, dtype=torch.int32), bounds, 1)
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.arange(n), torch.zeros(n, dtype=torch.long), cache, batch,
              logits_at=torch.arange(n))
    assert prefill_flops(model.args, [1] * n) == counter.get_total_flops()


def test_a_prompt_found_cached_leaves_only_the_rest_to_compute():
    # Its first 4 tokens cached: computing them alone, then the rest after them, is the whole
    # prompt's work and one more output head (each prefill computes its last token's logits).
    args = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=0).args
    head = 2 * args.dim * args.vocab_size
    assert (prefill_flops(args, [4]) + prefill_flops(args, [10], [4])
            == prefill_flops(args, [10]) + head)


def test_decode_reads_every_weight_but_the_embedding_table():
    untied = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=0)
    params = sum(p.numel() for p in untied.parameters())
    embedding = untied.args.vocab_size * untied.args.dim
    assert weight_bytes_read_per_step(untied) == 4 * (params - embedding)


def test_workload_w_is_what_the_paged_script_would_run():
    w = script_arguments(parse_arguments(["paged"]))
    assert (w.num_requests, w.max_new_tokens, w.max_seq_len, w.block_size) == (256, 256, 1536, 256)
    assert w.random_weights and w.model == "8b" and w.attn == "flash" and w.script == "llama3_paged.py"
    naive = script_arguments(parse_arguments(["naive", "--eager", "--num-requests", "49"]))
    assert naive.eager and naive.num_requests == 49 and naive.block_size is None


def test_workload_p_is_long_prompts_of_sharegpt_text_cut_to_length():
    from plumbing.inputs import PROMPTS_FILE, load_tokenizer, read_records
    from tools.bench import long_prompts
    a = parse_arguments(["virtual", "--workload", "P"])
    assert (a.num_requests, a.prompt_tokens, a.new_tokens, a.continuous) == (256, 4096, 16, True)
    tokenizer = load_tokenizer()
    prompts = long_prompts(tokenizer, 3, 500)
    assert [len(p) for p in prompts] == [500] * 3 and prompts[1][0] == tokenizer.bos_id
    # Consecutive pieces of the text of the first conversations' turns, in order.
    first_turns = "".join(t["value"] for r in read_records(PROMPTS_FILE)[:40] for t in r["conversations"])
    text = tokenizer.decode(prompts[0][1:] + prompts[1][1:] + prompts[2][1:])
    assert first_turns.startswith(text)


def test_decode_flops_are_the_matmuls_pytorch_counts():
    from llama3_paged import DecodeBatch
    from tools.bench import decode_flops_per_token
    model = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=0)
    a, batch, cached = model.args, 3, 5
    cache = KVCache(a, batch, 8, torch.float32, "cpu", TorchAttention())
    step = DecodeBatch(torch.arange(batch) * 8 + cached - 1,
                       torch.arange(batch, dtype=torch.int32)[:, None],
                       torch.full((batch,), cached, dtype=torch.int32), cached)
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.arange(batch), torch.full((batch,), cached - 1), cache, step)
    # The projections and the output head are the step's matrix multiplies (aten.mm); the
    # attention over the cache is left to the K/V bytes.
    assert batch * decode_flops_per_token(a) == counter.get_flop_counts()["Global"][torch.ops.aten.mm]


def test_a_step_floor_is_bound_by_the_weights_when_small_and_the_flops_when_large():
    from tools.bench import step_floor_seconds
    hardware = {"matmul_flops_per_second": 1e15, "copy_bandwidth_bytes_per_second": 4e12}
    weights, per_token = 16e9, 15e9  # 8B in bf16: 16 GB read, ~15 GFLOP per token
    # Batch 1: reading 16 GB (4 ms) beats computing 15 GFLOP (15 us); plus 4 GB of K/V (1 ms).
    assert step_floor_seconds(1, 4e9, weights, per_token, hardware) == 16e9 / 4e12 + 4e9 / 4e12
    # Batch 512: 7.68 TFLOP take 7.68 ms, longer than the weights' 4 ms.
    assert step_floor_seconds(512, 0, weights, per_token, hardware) == 512 * 15e9 / 1e15


def test_a_profiles_floor_counts_the_profiled_runs_token_by_token():
    # Prompts of 3 and 5 tokens drawing 3 and 2 tokens: decode step 1 runs both (K/V of 4 and 6
    # tokens cached), step 2 the first alone (5); 3 tokens decoded. Rates chosen so that step 1's
    # projections are bound by their FLOPs and step 2's by reading the weights.
    from tools.bench import decode_flops_per_token, profile_floor
    args = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=0).args
    rate, bandwidth, weights, kv_bytes = 1e12, 1e9, 1e5, 1000.0
    hardware = {"matmul_flops_per_second": rate, "copy_bandwidth_bytes_per_second": bandwidth}
    floor = profile_floor(args, [[7] * 3, [7] * 5], [3, 2], kv_bytes, weights, hardware)
    flops = decode_flops_per_token(args)
    assert flops / rate < weights / bandwidth < 2 * flops / rate
    decode = floor["decode_seconds_per_token"]
    assert decode["matmul"] == pytest.approx((2 * flops / rate + weights / bandwidth) / 3)
    assert decode["attention"] == pytest.approx((4 + 6 + 5) * kv_bytes / bandwidth / 3)
    # Prefill: the query at position t meets t + 1 keys, 2 * head_dim FLOPs each for QK^T and PV.
    attention = sum(4 * args.head_dim * (t + 1) for n in (3, 5) for t in range(n))
    attention *= args.n_heads * args.n_layers
    assert floor["prefill_seconds"]["attention"] == pytest.approx(attention / rate)
    assert floor["prefill_seconds"]["matmul"] == pytest.approx(
        (prefill_flops(args, [3, 5]) - attention) / rate)


def test_the_gpu_waits_for_what_the_steps_wall_time_has_beyond_their_gpu_time():
    from engine.model_runner import EngineGeneration, EngineSnapshot
    steps = [EngineSnapshot(i, 4, 64, 8, seconds=t) for i, t in enumerate([0.010, 0.012, 0.011])]
    generation = EngineGeneration([], 0.0, decode_seconds=0.036, timeline=steps)
    assert gpu_wait_seconds_per_step(generation) == pytest.approx((0.036 - 0.033) / 3)
    assert gpu_wait_seconds_per_step(EngineGeneration([], 0.0, 0.0, [])) == 0.0


def test_workload_n_draws_what_nano_vllms_bench_py_draws():
    import random
    from tools.bench import nano_vllm_requests
    # nano-vllm's bench.py, its lines as they are (module-level random, seed 0):
    random.seed(0)
    prompt_token_ids = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                        for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert nano_vllm_requests(256) == (prompt_token_ids, max_tokens)
    a = parse_arguments(["paged", "--workload", "N"])
    assert (a.num_requests, a.max_seq_len, a.continuous) == (256, 2048, True)
    assert max(map(len, prompt_token_ids)) + max(max_tokens) <= a.max_seq_len


@pytest.mark.parametrize("device, attention, extra, compiles", [
    ("cuda", "flash", [], True),  # the default on CUDA, as vLLM's and nano-vllm's
    ("cuda", "flash", ["--eager"], False),  # --eager: today's eager path, unchanged
    ("cuda", "flash", ["--kv-cache-dtype", "fp8"], True),  # the FP8 cache too (H200: faster)
    ("cuda", "torch", [], False),
    ("cpu", "torch", [], False),
])
def test_layers_compile_by_default_only_where_they_can(device, attention, extra, compiles):
    from types import SimpleNamespace
    import dataclasses
    from engine.config import parse_script_arguments
    from engine.loader import compiles_by_default
    args = parse_script_arguments("paged", ["4", "--random-weights", "--device", "cpu", *extra])
    args = dataclasses.replace(args, device=torch.device(device))  # the choice reads the type
    assert compiles_by_default(args, SimpleNamespace(name=attention)) is compiles


@pytest.mark.parametrize("script, gpu, extra, kernel", [
    ("paged", (9, 0), [], "triton"),  # H100/H200, bf16: the table's measured entry
    ("paged", (9, 0), ["-q", "fp8"], "triton"),
    ("paged", (9, 0), ["--dtype", "fp16"], "flash"),  # not measured: flash-attn's own
    ("paged", (8, 0), [], "flash"),  # an A100: not measured
    ("paged", (8, 0), ["--kv-cache-dtype", "fp8"], "triton"),  # flash-attn 2 reads no float8
    ("paged", (9, 0), ["--decode-kernel", "flash"], "flash"),  # the flag overrides the table
    ("paged", (8, 0), ["--decode-kernel", "triton"], "triton"),
    ("paged", (9, 0), ["--attn", "triton"], "flash"),  # no flash-attn prefill: nothing to pair
    ("naive", (9, 0), [], "flash"),  # only paged has the choice
    ("virtual", (9, 0), [], "flash"),
])
def test_the_engine_decodes_with_the_kernel_its_table_measured_faster(script, gpu, extra, kernel,
                                                                      monkeypatch):
    import dataclasses
    from engine import loader
    from engine.config import parse_script_arguments
    args = parse_script_arguments(script, ["4", "--random-weights", "--attn", "flash", *extra])
    args = dataclasses.replace(args, device=torch.device("cuda"))  # the choice reads the type
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: gpu)
    monkeypatch.setattr(loader, "importable", lambda module: True)  # flash-attn, as on a GPU
    assert loader.decode_kernel(args) == kernel


def test_the_lessons_rope_is_each_pairs_rotation_matrix():
    # apply_rope's complex multiply against the rotation a float64 rotation matrix gives (the
    # compiled layers' kernel is held to apply_rope's bytes on the GPU: tests/test_gpu.py).
    from llama3_paged import apply_rope
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, 64, dtype=torch.float64, generator=g)
    angles = torch.rand(9, 32, dtype=torch.float64, generator=g) * 1000
    rotations = torch.polar(torch.ones_like(angles), angles)
    # The truth: each pair times the 2x2 rotation matrix of its angle.
    c, s = angles.cos()[:, None, :, None, None], angles.sin()[:, None, :, None, None]
    matrices = torch.cat([torch.cat([c, -s], -1), torch.cat([s, c], -1)], -2)  # [9, 1, 32, 2, 2]
    truth = (matrices @ x.unflatten(-1, (-1, 2))[..., None]).flatten(-3)
    # It rotates in float32 (x.float()), whatever x's type: within float32's rounding.
    assert torch.allclose(apply_rope(x, rotations), truth, rtol=0, atol=1e-5)


def test_short_passes_launched_from_python_run_eager_and_graphs_record_them_compiled():
    # engine/model_runner.py's ModelForward, on a compiled stand-in for the model (dynamo's
    # counting backend: it counts what is compiled and runs it as is). A decode step of 520 rows,
    # past the largest CUDA graph, compiles nothing; the same step recorded for a graph
    # (at_any_length) and a step of COMPILED_FROM_ROWS rows compile.
    from torch._dynamo.testing import CompileCounter
    from engine.compiled_layers import COMPILED_FROM_ROWS
    from engine.model_runner import ModelForward
    counter = CompileCounter()

    class CompiledStandIn:  # no layers of its own for ModelForward to compile
        layers = []
        __call__ = staticmethod(torch.compile(
            lambda tokens, positions, kv_cache, batch, logits_at=None: tokens * 2, backend=counter))

    forward = ModelForward(CompiledStandIn(), compiled=True)
    decode = AttentionMetadata(Phase.DECODE, None)
    assert torch.equal(forward(torch.ones(520), None, None, decode), torch.full((520,), 2.0))
    assert counter.frame_count == 0
    with forward.at_any_length():
        forward(torch.ones(520), None, None, decode)
    assert counter.frame_count == 1
    forward(torch.ones(COMPILED_FROM_ROWS), None, None, decode)
    assert counter.frame_count == 2  # a larger step: compiled for its size


def test_compiled_layers_share_one_graph_across_layers_and_leave_torchs_settings_as_they_were():
    # ModelForward runs the compiled layers inside engine/compiled_layers.py's compiler_settings.
    # Layers that differ only in their index (an int attribute) then share one graph; called
    # outside those settings, dynamo guards each index as a constant and compiles again. Around
    # the call, and after building ModelForward, dynamo's settings are what they were.
    from torch._dynamo.testing import CompileCounter
    from engine.model_runner import ModelForward
    counter = CompileCounter()

    class Layer(torch.nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.index = index

        def forward(self, x):
            return x * self.index

    class Stacked:  # compiles its own layers (counted), so ModelForward has none to compile
        layers = []

        def __init__(self):
            self.own = [Layer(i) for i in (1, 2, 3)]
            for layer in self.own:
                layer.compile(backend=counter, dynamic=True)

        def __call__(self, tokens, positions, kv_cache, batch, logits_at=None):
            for layer in self.own:
                tokens = layer(tokens)
            return tokens

    before = dict(torch._dynamo.config.get_config_copy())
    torch._dynamo.reset()
    forward = ModelForward(Stacked(), compiled=True)
    assert dict(torch._dynamo.config.get_config_copy()) == before
    decode = AttentionMetadata(Phase.DECODE, None)
    with forward.at_any_length():
        assert torch.equal(forward(torch.ones(4), None, None, decode), torch.full((4,), 6.0))
    assert counter.frame_count == 1  # one graph for the three indexes
    assert dict(torch._dynamo.config.get_config_copy()) == before
    torch._dynamo.reset()
    Stacked()(torch.ones(4), None, None, decode)  # the same layers, outside the settings
    assert counter.frame_count == 1 + 3


def test_compiled_layers_leave_short_prefill_passes_eager():
    # A pass shorter than COMPILED_FROM_TOKENS compiles nothing and gives the eager logits:
    # launching the compiled layers took longer than the eager kernels (engine/compiled_layers.py).
    from torch._dynamo.utils import counters
    from engine.compiled_layers import COMPILED_FROM_TOKENS, warm_up_prompts
    from engine.kv_cache import EngineKVCache
    from engine.model_runner import ModelForward
    model = random_model(Llama, "tiny", "cpu", torch.float32, 256, seed=5)
    cache = EngineKVCache(model.args, 16, 16, torch.float32, "cpu", TorchAttention())
    tokens = torch.arange(40) % 100 + 1
    batch = AttentionMetadata(Phase.PREFILL, torch.arange(40),
                              torch.tensor([0, 25, 40], dtype=torch.int32), [0, 25, 40], 25)
    positions = torch.cat([torch.arange(25), torch.arange(15)])
    logits_at = torch.tensor([24, 39])
    eager = model(tokens, positions, cache, batch, logits_at=logits_at)
    forward = ModelForward(model, compiled=True)
    graphs_before = counters["stats"]["unique_graphs"]
    assert torch.equal(forward(tokens, positions, cache, batch, logits_at=logits_at), eager)
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing was compiled
    # The warm-up passes: short; long alone; two long together (the count of one is its own).
    from types import SimpleNamespace
    pool = lambda blocks: SimpleNamespace(num_blocks=blocks, block_size=16)
    passes = warm_up_prompts(True, pool(1000), 8192, 8)
    assert [[len(p) for p in prompts] for prompts in passes] == [
        [32], [COMPILED_FROM_TOKENS], [COMPILED_FROM_TOKENS] * 2]
    assert len(warm_up_prompts(False, pool(1000), 8192, 8)) == 1
    assert max(map(len, warm_up_prompts(True, pool(1000), 109, 8)[2])) == 100  # + 8 + 1 = 109
    assert max(map(len, warm_up_prompts(True, pool(10), 8192, 8)[2])) == 4 * 16 - 8  # half the pool
    assert warm_up_prompts(True, pool(2), 8192, 8) == []  # too small for two prompts: no warm-up


def test_the_clock_sampler_reads_nvidia_smis_samples_and_skips_what_is_not_one(tmp_path,
                                                                               monkeypatch):
    # A stand-in nvidia-smi: ten samples (SM MHz, W), then "[N/A]" and a half-written line, then
    # it samples on until stopped, as the real one does under -lms.
    lines = [f"{1000 + 100 * i}, {600 + i}" for i in range(10)] + ["[N/A], [N/A]", "19"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{x}'" for x in lines)
                    + "\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda: SimpleNamespace(uuid="x"))
    sampler = ClockSampler()
    time.sleep(0.5)  # the samples written before it is stopped
    clocks = sampler.stop()
    assert clocks == {"sm_clock_mhz": 1450, "sm_clock_tenth_mhz": 1100, "power_watts": 604.5,
                      "samples": 10}
    assert "SM 1,450 MHz median, a tenth of the time below 1,100; power 604 W" in clock_line(clocks)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert ClockSampler().stop() == {} and "not sampled" in clock_line({})
