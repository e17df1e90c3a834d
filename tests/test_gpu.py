"""flash-attn against the PyTorch reference, on the GPU. Skipped where CUDA or flash-attn is missing."""

import functools
import gc
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import EngineKVCache, FlashAttentionAfterPrefix, TorchAttentionAfterPrefix
from conftest import generate
from features.sharing.block_manager import SharingBlockManager
from plumbing.cli import importable
from block_manager import BlockManager
from plumbing.inputs import random_model
from llama3_paged import Llama
from llama3_paged import DecodeBatch, PrefillBatch
from virtual_pages import PageManager
from engine.sampler import draw, sampler

if importable("triton"):
    from features.triton_attention import TritonAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and importable("flash_attn")), reason="needs CUDA and flash-attn")]


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("gqa", [1, 4])
def test_flash_paged_decode_matches_the_reference(gqa):
    g = torch.Generator(device="cuda").manual_seed(gqa)
    batch, n_kv, d, block_size, num_blocks = 24, 8, 128, 256, 200
    lengths = torch.randint(1, 3000, (batch,), device="cuda", generator=g)
    max_blocks = math.ceil(3000 / block_size)
    table = torch.randint(0, num_blocks, (batch, max_blocks), device="cuda", generator=g).int()
    keys = torch.randn(num_blocks, block_size, n_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(num_blocks, block_size, n_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, n_kv * gqa, d, device="cuda", dtype=torch.bfloat16, generator=g)
    info = DecodeBatch(None, table, lengths.int(), int(lengths.max()))
    flash = FlashAttentionAfterPrefix().decode(q, keys, values, info)
    reference = TorchAttentionAfterPrefix().decode(q.float(), keys.float(), values.float(), info)
    assert relative_error(flash, reference) < 2e-2


@pytest.mark.parametrize("attention", ["flash", "triton"])
def test_packed_prefill_matches_the_reference(attention):
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 77, 256, 513, 1000]
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    T = bounds[-1]
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    info = PrefillBatch(None, torch.tensor(bounds, dtype=torch.int32, device="cuda"), bounds, max(lengths))
    backend = FlashAttentionAfterPrefix() if attention == "flash" else TritonAttention()
    packed = backend.prefill(q, k, v, info)
    reference = TorchAttentionAfterPrefix().prefill(q.float(), k.float(), v.float(), info)
    assert relative_error(packed, reference) < 2e-2


MAX_SEQ_LEN = 2048


def generate_on_gpu(model, prompts, budgets, num_blocks, block_size, graphs=False,
                    attention=FlashAttentionAfterPrefix, continuous=False, samples=1, share=False,
                    sampler=None, max_running=None, max_batched_tokens=None, swap_blocks=0,
                    compiled=False, overlap=False, cache_class=None,
                    longest_first=False):
    """With `share`, samples fork and prompts share cached prefixes (prefix caching)."""
    prompts = [p for p in prompts for _ in range(samples)]
    budgets = [b for b in budgets for _ in range(samples)]
    n = len(prompts)
    # Compiled, the model's layers are compiled for good: a test compiles a model of its own.
    cache_class = cache_class or functools.partial(EngineKVCache, spare_slot=True)
    cache = cache_class(model.args, num_blocks, block_size, model.output.weight.dtype, "cuda",
                        attention())
    max_blocks = math.ceil(MAX_SEQ_LEN / block_size)
    manager = (SharingBlockManager(cache, n, max_blocks, prefix_caching=True) if share
               else BlockManager(num_blocks, block_size, n, max_blocks, "cuda"))
    result = generate(model, cache, manager, prompts, budgets, MAX_SEQ_LEN, continuous=continuous,
                      max_running=max_running, chunk_tokens=8192, sampler=sampler, graphs=graphs,
                      max_batched_tokens=max_batched_tokens, swap_blocks=swap_blocks,
                      overlap=overlap, longest_first=longest_first, compiled=compiled)
    assert manager.num_free_blocks == num_blocks and not manager.owned_blocks
    result.num_preemptions = getattr(result.scheduler, "num_preemptions", 0)
    result.num_swapped = getattr(result.scheduler, "num_swapped", 0)
    result.first_cached_tokens = manager.first_cached[:n].tolist() if share else [0] * n
    result.num_copied_blocks = manager.num_copied if share else 0
    return result


def random_prompts(n, generator):
    return [torch.randint(0, 128_000, (int(length),), generator=generator).tolist()
            for length in torch.randint(20, 700, (n,), generator=generator)]


def prompts_and_budgets(n, seed, most_tokens):
    """n random prompts, each allowed 1 to most_tokens new tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, g)
    return prompts, torch.randint(1, most_tokens + 1, (n,), generator=g).tolist()


def test_naive_and_paged_generate_the_same_tokens_with_flash_attn():
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=0)
    prompts = random_prompts(8, torch.Generator().manual_seed(0))
    naive = generate_on_gpu(model, prompts, [32] * 8, num_blocks=8, block_size=MAX_SEQ_LEN)
    paged = generate_on_gpu(model, prompts, [32] * 8, num_blocks=64, block_size=256)
    assert naive.output_tokens == paged.output_tokens


def test_smollm2_shapes_head_dim_64_and_three_query_heads_per_kv_head():
    """SmolLM2's shapes (its real weights cannot reach the GPU machine: see README): flash-attn's
    head_dim-64 kernels against the reference, and naive, paged and graph-decoded runs agree."""
    g = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.randint(1, 3000, (16,), device="cuda", generator=g)
    table = torch.randint(0, 200, (16, math.ceil(3000 / 256)), device="cuda", generator=g).int()
    keys, values = (torch.randn(200, 256, 3, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
    q = torch.randn(16, 9, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    info = DecodeBatch(None, table, lengths.int(), int(lengths.max()))
    flash = FlashAttentionAfterPrefix().decode(q, keys, values, info)
    reference = TorchAttentionAfterPrefix().decode(q.float(), keys.float(), values.float(), info)
    assert relative_error(flash, reference) < 2e-2
    model = random_model(Llama, "smollm2", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=5)
    prompts = [[t % 49_152 for t in p] for p in random_prompts(8, torch.Generator().manual_seed(5))]
    naive = generate_on_gpu(model, prompts, [32] * 8, num_blocks=8, block_size=MAX_SEQ_LEN)
    paged = generate_on_gpu(model, prompts, [32] * 8, num_blocks=64, block_size=256)
    graphs = generate_on_gpu(model, prompts, [32] * 8, num_blocks=64, block_size=256, graphs=True)
    assert naive.output_tokens == paged.output_tokens == graphs.output_tokens


def test_cuda_graphs_generate_the_same_tokens_as_eager_decoding():
    # Budgets from 1 to 40: the batch shrinks from 20 through buckets 24, 16, 8, 4, 2 and 1,
    # so most steps run padding rows.
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=1)
    prompts, budgets = prompts_and_budgets(20, seed=1, most_tokens=40)
    eager = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256)
    graphs = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True)
    assert graphs.output_tokens == eager.output_tokens
    assert all(s.seconds > 0 for s in graphs.timeline)


def test_cuda_graphs_past_512_rows_generate_the_eager_tokens(monkeypatch):
    # 600 requests allowed 1 to 12 new tokens: the decode batch shrinks from some 550 through
    # the buckets of 32 above 512 into those below, each step replayed by a graph.
    from features.cuda_graphs import GraphDecoder
    model = random_model(Llama, "tiny", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128_000, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (600,), generator=g)]
    budgets = torch.randint(1, 13, (600,), generator=g).tolist()
    eager = generate_on_gpu(model, prompts, budgets, num_blocks=700, block_size=256)
    replayed, replay = [], GraphDecoder.step
    monkeypatch.setattr(GraphDecoder, "step", lambda self, tokens, positions, rows, slots: (
        replayed.append(len(rows)) or replay(self, tokens, positions, rows, slots)))
    graphs = generate_on_gpu(model, prompts, budgets, num_blocks=700, block_size=256, graphs=True)
    assert graphs.output_tokens == eager.output_tokens
    assert max(replayed) > 512 and len(replayed) == len(graphs.timeline)


@pytest.mark.parametrize("script, args", [
    ("llama3_paged.py", ["--block-size", "16"]),  # flash-attn's pages are multiples of 256
    ("llama3_naive.py", ["--max-seq-len", "1000"]),  # the naive block is max_seq_len long
])
def test_a_block_size_flash_attn_cannot_use_exits_2(script, args):
    out = subprocess.run([sys.executable, str(ROOT / script), "2", "--random-weights", "--model",
                          "tiny", "--attn", "flash", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "multiple of 256" in out.stderr and "Traceback" not in out.stderr


needs_triton = pytest.mark.skipif(not importable("triton"), reason="needs Triton")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_triton_paged_decode_matches_float64_attention(gqa, block_size, dtype):
    from features.triton_attention import paged_decode
    g = torch.Generator(device="cuda").manual_seed(gqa * 1000 + block_size)
    batch, n_kv, d, longest = 10, 2, 128, 4096
    lengths = torch.randint(1, longest + 1, (batch,), device="cuda", generator=g)
    lengths[:3] = torch.tensor([1, longest, block_size])  # one token, the longest, one full block
    max_blocks = math.ceil(longest / block_size)
    num_blocks = batch * max_blocks + 7
    # Every request's blocks scattered over the pool, no block shared.
    table = torch.randperm(num_blocks, device="cuda", generator=g)[:batch * max_blocks]
    table = table.view(batch, max_blocks).int()
    keys = torch.randn(num_blocks, block_size, n_kv, d, device="cuda", generator=g).to(dtype)
    values = torch.randn(num_blocks, block_size, n_kv, d, device="cuda", generator=g).to(dtype)
    q = torch.randn(batch, n_kv * gqa, d, device="cuda", generator=g).to(dtype)
    out = paged_decode(q, keys, values, table, lengths.int())
    assert not out.isnan().any()
    reference = TorchAttentionAfterPrefix().decode(q.double(), keys.double(), values.double(),
                                        DecodeBatch(None, table, lengths.int(), longest))
    for r in range(batch):  # each request on its own: an unwritten row cannot hide in an average
        assert relative_error(out[r], reference[r]) < 2e-2, f"request {r}, {lengths[r]} tokens"


@needs_triton
def test_triton_and_flash_attn_generate_the_same_tokens():
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=2)
    prompts = random_prompts(8, torch.Generator().manual_seed(2))
    flash = generate_on_gpu(model, prompts, [33] * 8, num_blocks=64, block_size=256)
    triton = generate_on_gpu(model, prompts, [33] * 8, num_blocks=1024, block_size=16,
                                 attention=TritonAttention)
    assert triton.output_tokens == flash.output_tokens  # the prefill token and 32 decode steps


@needs_triton
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 256])  # tiles of 128: over 8 blocks, inside one
def test_triton_decode_of_float8_blocks_matches_float64_dequantize_then_attend(gqa, block_size):
    from features.triton_attention import paged_decode
    from features.fp8.cache import FP8_MAX, dequantize, quantize
    g = torch.Generator(device="cuda").manual_seed(gqa)
    batch, n_kv, d, longest = 10, 2, 128, 3000
    lengths = torch.randint(1, longest + 1, (batch,), device="cuda", generator=g)
    max_blocks = math.ceil(longest / block_size)
    table = torch.randperm(batch * max_blocks + 5, device="cuda", generator=g)[:batch * max_blocks]
    table = table.view(batch, max_blocks).int()
    keys, values = (torch.randn(batch * max_blocks + 5, block_size, n_kv, d, device="cuda",
                                generator=g) * 4 for _ in range(2))
    scales = torch.stack([keys.abs().amax(), values.abs().amax()]) * 2 / FP8_MAX
    keys8, values8 = quantize(keys, scales[0]), quantize(values, scales[1])
    q = torch.randn(batch, n_kv * gqa, d, device="cuda", generator=g).bfloat16()
    out = paged_decode(q, keys8, values8, table, lengths.int(), kv_scales=scales)
    reference = TorchAttentionAfterPrefix().decode(
        q.double(), dequantize(keys8, scales[0], torch.float64),
        dequantize(values8, scales[1], torch.float64), DecodeBatch(None, table, lengths.int(), longest))
    errors = (out.double() - reference).abs()
    assert errors.max() < 2e-2 * reference.abs().max(), errors.max()  # bf16 sums, not the format


def fresh_rows(dtype, n_kv: int, d: int, num_slots: int, spread: float = 1.0):
    """A step's k and v for 300 tokens ([300, n_kv, d], their rows strided as the model's split
    of qkv gives them) and the slots they go to, 300 of num_slots at random."""
    g = torch.Generator(device="cuda").manual_seed(n_kv)
    qkv = (torch.randn(300, 6 * n_kv, d, device="cuda", generator=g) * spread).to(dtype)
    slot_mapping = torch.randperm(num_slots, device="cuda", generator=g)[:300]
    return qkv[:, 4 * n_kv:5 * n_kv], qkv[:, 5 * n_kv:], slot_mapping


def q_and_k(dtype, heads: int, tokens: int):
    """q and k of `heads` heads as the model's split of qkv gives them (strided), and each
    token's rotations, at random positions up to 8,192."""
    g = torch.Generator(device="cuda").manual_seed(heads)
    qkv = torch.randn(tokens, heads + 8, 128, device="cuda", generator=g).to(dtype)
    angles = torch.rand(tokens, 64, device="cuda", generator=g) * 8192
    return qkv[:, :heads], torch.polar(torch.ones_like(angles), angles)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads, tokens", [(40, 300), (20, 7), (5, 1)])  # 8B; halved; a part
def test_the_rope_kernel_gives_the_bytes_of_the_lessons_complex_multiply(dtype, heads, tokens):
    from engine.rope_kernel import rotate_pairs
    from llama3_paged import apply_rope
    x, rotations = q_and_k(dtype, heads, tokens)
    assert torch.equal(rotate_pairs(x, rotations), apply_rope(x, rotations))


@needs_triton
def test_compiled_apply_rope_runs_the_rope_kernel():
    # Compiled, the layers' call of the lesson's apply_rope is traced as engine/compiled_layers.py's
    # substitute: the kernel's op in the generated code and no complex multiply; the lesson's bytes.
    from torch._inductor.utils import run_and_get_code
    import engine.compiled_layers  # noqa: F401 (the substitute)
    from llama3_paged import apply_rope
    x, rotations = q_and_k(torch.bfloat16, 40, 300)

    def rotate(x, rotations):  # as the layers call it
        return apply_rope(x, rotations)

    torch._dynamo.reset()
    compiled, (code, *_) = run_and_get_code(torch.compile(rotate, dynamic=True), x, rotations)
    assert "compiled_layers.rope" in code and "view_as_complex" not in code, code
    assert torch.equal(compiled, apply_rope(x, rotations))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_kv, d", [(8, 128), (3, 64)])  # 8B's rows; rows of 192, padded to 256
def test_the_one_kernel_write_stores_the_bytes_of_the_lessons_index_copy(dtype, n_kv, d):
    from engine.cache_write import write_rows
    num_slots = 1000
    k, v, slot_mapping = fresh_rows(dtype, n_kv, d, num_slots)
    lesson, kernel = ([torch.zeros(num_slots, n_kv, d, dtype=dtype, device="cuda") for _ in "kv"]
                      for _ in range(2))
    for pool, rows in zip(lesson, (k, v)):
        pool.index_copy_(0, slot_mapping, rows)
    write_rows(k, v, slot_mapping, *kernel)
    assert all(torch.equal(a, b) for a, b in zip(lesson, kernel))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_kv, d", [(8, 128), (3, 64)])  # 8B's rows; rows of 192, padded to 256
def test_the_float8_write_kernel_stores_the_bytes_of_the_pytorch_write(dtype, n_kv, d):
    from types import SimpleNamespace
    from features.fp8.cache import FP8, FP8_MAX, Float8Writes
    num_slots = 1000
    k, v, slot_mapping = fresh_rows(dtype, n_kv, d, num_slots, spread=3)
    batch = AttentionMetadata(Phase.DECODE, slot_mapping)
    pools = []
    for backend in ("torch", "flash"):  # the PyTorch reference's write, then the kernel's
        writer = Float8Writes()
        writer.attention_backend = SimpleNamespace(name=backend)
        writer.init_scales(1, "cuda", group=None)
        writer.scales[0] = torch.tensor([0.01, 0.02])  # |k| / 0.01 reaches ~1,200: past 448
        writer.scaled = [True]
        slots = [torch.zeros(num_slots, n_kv, d, dtype=FP8, device="cuda") for _ in range(2)]
        writer.write_float8(0, k, v, batch, *slots)
        pools.append([pool.view(torch.uint8) for pool in slots])
    (key_reference, value_reference), (key_kernel, value_kernel) = pools
    assert (key_reference.view(FP8).float().abs() == FP8_MAX).any()  # the clamp was exercised
    assert torch.equal(key_kernel, key_reference) and torch.equal(value_kernel, value_reference)


@needs_triton
def test_an_fp8_cache_gives_the_same_tokens_through_the_reference_and_the_triton_kernel():
    from features.fp8.cache import FP8KVCache
    from features.triton_attention import TritonDecode
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=6)
    prompts = random_prompts(8, torch.Generator().manual_seed(6))
    reference = generate_on_gpu(model, prompts, [33] * 8, num_blocks=1024, block_size=16,
                                attention=TorchAttentionAfterPrefix, cache_class=FP8KVCache)
    kernel = generate_on_gpu(model, prompts, [33] * 8, num_blocks=1024, block_size=16,
                             attention=TritonDecode, cache_class=FP8KVCache, graphs=True)
    assert kernel.output_tokens == reference.output_tokens


@pytest.mark.parametrize("attention", ["flash", pytest.param("triton", marks=needs_triton)])
def test_an_fp8_prefill_after_a_cached_prefix_matches_float64_dequantize_then_attend(attention):
    # flash-attn's varlen kernel (and the Triton path's SDPA) over the bf16 copy of the blocks
    from test_fp8 import outputs_after_a_cached_prefix
    backend = FlashAttentionAfterPrefix() if attention == "flash" else TritonAttention()
    out, expected = outputs_after_a_cached_prefix(backend, "cuda", torch.bfloat16, block_size=256)
    assert relative_error(out, expected) < 2e-2


@needs_triton
def test_an_fp8_cache_gives_the_eager_tokens_through_compiled_layers_in_float32():
    # The layers compile around the FP8 cache's attention (quantizing writes, float8 decode) as
    # around the bf16 cache's: in float32 the fused kernels round as the eager ones do.
    from features.fp8.cache import FP8KVCache
    model = random_model(Llama, "1b", "cuda", torch.float32, MAX_SEQ_LEN, seed=8)
    prompts, budgets = prompts_and_budgets(8, seed=8, most_tokens=40)
    kw = {"num_blocks": 1024, "block_size": 16, "attention": TritonAttention, "graphs": True,
          "cache_class": FP8KVCache}
    eager = generate_on_gpu(model, prompts, budgets, **kw)
    compiled = generate_on_gpu(model, prompts, budgets, compiled=True, **kw)
    assert compiled.output_tokens == eager.output_tokens


@needs_triton
def test_flash_attn_prefill_with_the_triton_decode_kernel_gives_flash_attns_tokens():
    from features.triton_attention import TritonDecode
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=3)
    prompts = random_prompts(8, torch.Generator().manual_seed(3))
    budgets = [40, 33, 5, 40, 17, 1, 40, 40]  # prompts of 20-700 tokens: most span 2-3 blocks
    flash = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True)
    mixed = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True,
                            attention=TritonDecode)
    assert mixed.output_tokens == flash.output_tokens


@needs_triton
def test_the_decode_kernel_tool_times_triton_beside_flash_attn_on_the_same_answers(tmp_path):
    from tools import decode_kernel_cost
    decode_kernel_cost.main(["--cases", "W", "W-16", "--tiles", "64,128", "--warps", "4",
                             "--json", str(tmp_path / "k.json")])
    blocks_256, blocks_16 = json.loads((tmp_path / "k.json").read_text())["cases"]
    assert blocks_256["flash_seconds"] > 0 and blocks_16["flash_seconds"] is None
    for run in blocks_256["triton"]:  # outputs of about 0.1: bf16 rounds at about 1e-3 there
        assert run["seconds"] > 0 and run["max_difference_from_flash"] < 1e-2


def test_continuous_batching_in_an_ample_pool_gives_the_static_tokens_with_cuda_graphs():
    # All prompts fit one prefill chunk and the pool never runs short: the same batches as static.
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128_000, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 500, (12,), generator=g)]
    budgets = torch.randint(1, 60, (12,), generator=g).tolist()
    static = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True)
    continuous = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256,
                                 graphs=True, continuous=True)
    assert continuous.num_preemptions == 0 and continuous.output_tokens == static.output_tokens


@pytest.mark.parametrize("max_batched_tokens", [None, 40])
def test_preemption_changes_no_token_on_the_gpu_in_float32(max_batched_tokens):
    # In bf16 a recomputed prefill and the decode steps it replaces round differently, and greedy
    # decoding of random weights turns any difference into a new sequence; float32 does not.
    # Short prompts that grow by 120 tokens in a pool of twice the largest one's need: admitted
    # while small, they outgrow it (a CPU replay of the scheduler preempts 14 times). With
    # max_batched_tokens, in mixed steps (engine/scheduler.py): prompts chunked, decode rows
    # computed as one-token chunks through the block table.
    model = random_model(Llama, "1b", "cuda", torch.float32, MAX_SEQ_LEN, seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128_000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 48, (10,), generator=g)]
    budgets = [120] * 10
    static = generate_on_gpu(model, prompts, budgets, num_blocks=512, block_size=16,
                             attention=TorchAttentionAfterPrefix)
    needed = max(math.ceil((len(p) + 119) / 16) for p in prompts)
    continuous = generate_on_gpu(model, prompts, budgets, num_blocks=2 * needed, block_size=16,
                                 attention=TorchAttentionAfterPrefix, continuous=True,
                                 max_batched_tokens=max_batched_tokens)
    assert continuous.num_preemptions > 0
    assert continuous.output_tokens == static.output_tokens


@pytest.mark.parametrize("attention, block_size", [(FlashAttentionAfterPrefix, 256), ("triton", 16)])
def test_swapped_requests_give_the_tokens_of_a_run_without_preemption_in_bfloat16(attention,
                                                                                 block_size):
    # Unlike recompute (above: float32 only), a swapped request continues from the very K/V it
    # left with, so even bf16 gives the tokens of the run that never preempted it.
    attention = TritonAttention if attention == "triton" else attention
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=6)
    g = torch.Generator().manual_seed(6)
    shortest = max(16, block_size - 48)  # prompts that outgrow their first block as they decode
    prompts = [torch.randint(0, 128_000, (int(n),), generator=g).tolist()
               for n in torch.randint(shortest, shortest + 32, (10,), generator=g)]
    budgets = [120] * 10
    static = generate_on_gpu(model, prompts, budgets, num_blocks=512, block_size=block_size,
                             attention=attention, graphs=True)
    needed = max(math.ceil((len(p) + 119) / block_size) for p in prompts)
    swapped = generate_on_gpu(model, prompts, budgets, num_blocks=2 * needed, block_size=block_size,
                              attention=attention, graphs=True, continuous=True, swap_blocks=64)
    assert swapped.num_swapped > 0 and swapped.num_swapped == swapped.num_preemptions
    assert swapped.output_tokens == static.output_tokens


@pytest.mark.parametrize("attention, block_size", [(FlashAttentionAfterPrefix, 256), ("triton", 16)])
def test_overlapped_steps_and_rows_longest_first_give_the_core_loops_tokens_in_bfloat16(
        attention, block_size):
    # The same batches in the same order, each queued before the last one's tokens are back: even
    # in bf16 the same tokens. Prompts that outgrow their first block in a pool of twice the
    # largest request's need (a CPU replay of the scheduler preempts 7 times with blocks of 256,
    # 13 with blocks of 16), and the batch shrinks through the CUDA-graph buckets.
    attention = TritonAttention if attention == "triton" else attention
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=8)
    g = torch.Generator().manual_seed(8)
    shortest = max(16, block_size - 48)
    prompts = [torch.randint(0, 128_000, (int(n),), generator=g).tolist()
               for n in torch.randint(shortest, shortest + 32, (10,), generator=g)]
    budgets = [120] * 10
    needed = max(math.ceil((len(p) + b - 1) / block_size) for p, b in zip(prompts, budgets))
    kw = {"num_blocks": 2 * needed, "block_size": block_size, "attention": attention,
          "graphs": True, "continuous": True}
    core = generate_on_gpu(model, prompts, budgets, **kw)
    overlapped = generate_on_gpu(model, prompts, budgets, overlap=True, **kw)
    assert core.num_preemptions > 0 and overlapped.num_preemptions == core.num_preemptions
    assert overlapped.output_tokens == core.output_tokens
    # Rows longest first (features/longest_first.py, the default on CUDA): each row is computed
    # on its own, so even in bf16 the tokens are the same.
    longest_first = generate_on_gpu(model, prompts, budgets, overlap=True, longest_first=True, **kw)
    assert longest_first.output_tokens == core.output_tokens


def test_compiled_layers_give_the_eager_tokens_in_float32():
    # Static and continuous batches (every CUDA-graph bucket from 8 down to 1 is replayed), the
    # prefill and the decode steps all through the compiled layers.
    model = random_model(Llama, "1b", "cuda", torch.float32, MAX_SEQ_LEN, seed=7)
    prompts, budgets = prompts_and_budgets(8, seed=7, most_tokens=40)
    kw = {"num_blocks": 1024, "block_size": 16, "attention": TritonAttention, "graphs": True}
    eager = generate_on_gpu(model, prompts, budgets, **kw)
    compiled = generate_on_gpu(model, prompts, budgets, compiled=True, **kw)
    continuous = generate_on_gpu(model, prompts, budgets, compiled=True, continuous=True,
                                 max_running=3, **kw)
    assert compiled.output_tokens == eager.output_tokens == continuous.output_tokens


@pytest.mark.skipif(not importable("cuda.bindings"), reason="needs cuda-python")
@pytest.mark.parametrize("ahead, start_mapped, overlap", [
    (False, False, False), (True, False, False), (True, True, False), (True, True, True)],
    ids=["sync", "ahead", "ahead-start-mapped", "ahead-start-mapped-overlapped"])
@pytest.mark.parametrize("layout", ["per-token", "per-layer"])
def test_virtual_rows_give_the_paged_and_naive_tokens_and_leak_no_page(layout, ahead, start_mapped,
                                                                        overlap):
    from features.virtual.kv_cache import EngineVirtualKVCache as VirtualKVCache
    from features.virtual.kv_cache import mapping_ahead_manager
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=0)
    prompts = random_prompts(8, torch.Generator().manual_seed(0))
    budgets = [32, 5, 17, 32, 1, 9, 32, 25]  # the batch shrinks: CUDA graphs pad with the spare row
    paged = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True)
    naive = generate_on_gpu(model, prompts, budgets, num_blocks=8, block_size=MAX_SEQ_LEN)
    cache = VirtualKVCache(model.args, 8, MAX_SEQ_LEN, torch.bfloat16, "cuda", FlashAttentionAfterPrefix(),
                           layout)
    # Every row could fill up; with mapping ahead, a pool of 3 rows' pages makes requests wait,
    # reuse rows and take back pages mapped ahead.
    num_pages = (3 if ahead else 8) * cache.pages_per_row
    cache.create_pages(num_pages)
    sizes = (num_pages, cache.tokens_per_page, 8, cache.pages_per_row)
    manager = (mapping_ahead_manager(*sizes, mapper=cache, device="cuda")
               if ahead else PageManager(*sizes, cache, "cuda"))
    if start_mapped:  # half the pool under the 8 empty rows: per-token 6 of a row's 32 pages
        manager.map_empty_rows()  # each; per-layer (3 pages of 2,048 tokens in all) none
        manager.map_empty_rows()
    virtual = generate(model, cache, manager, prompts, budgets, MAX_SEQ_LEN, chunk_tokens=8192,
                       graphs=True, continuous=ahead, max_running=3 if ahead else None,
                       overlap=overlap)
    assert virtual.output_tokens == paged.output_tokens == naive.output_tokens
    # Every page back in the pool; the spare row's first page and (ahead) idle pages still mapped.
    assert manager.num_free_blocks == num_pages and not manager.owned_blocks
    idle = 0
    if ahead:
        manager.mapper.wait(manager.mapper.asked)
        manager.close()
        idle = manager.num_idle_pages
        assert idle > 0
    assert len(cache.memory.mapped) == (1 + idle) * len(cache.ranges)
    assert cache.memory.num_maps - cache.memory.num_unmaps == (1 + idle) * len(cache.ranges)


@needs_triton
@pytest.mark.skipif(not importable("cuda.bindings"), reason="needs cuda-python")
@pytest.mark.parametrize("layout", ["per-token", "per-layer"])
def test_fp8_virtual_rows_give_the_fp8_paged_tokens(layout):
    # The same float8 bytes with the same scales, read by the same Triton kernel: through the
    # paged pool's block table (blocks of 256) or as one block per row (engine/
    # fp8_virtual_cache.py). The paged FP8 cache is held to the PyTorch reference above.
    from features.fp8.cache import FP8KVCache
    from engine.fp8_virtual_cache import FP8VirtualKVCache
    from features.triton_attention import TritonDecode
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=9)
    prompts = random_prompts(8, torch.Generator().manual_seed(9))
    budgets = [32, 5, 17, 32, 1, 9, 32, 25]  # the batch shrinks: CUDA graphs pad with the spare row
    paged = generate_on_gpu(model, prompts, budgets, num_blocks=64, block_size=256, graphs=True,
                            attention=TritonDecode, cache_class=FP8KVCache)
    cache = FP8VirtualKVCache(model.args, 8, MAX_SEQ_LEN, torch.bfloat16, "cuda", TritonDecode(),
                              layout)
    num_pages = 8 * cache.pages_per_row
    cache.create_pages(num_pages)
    manager = PageManager(num_pages, cache.tokens_per_page, 8, cache.pages_per_row, cache, "cuda")
    virtual = generate(model, cache, manager, prompts, budgets, MAX_SEQ_LEN, chunk_tokens=8192,
                       graphs=True)
    assert virtual.output_tokens == paged.output_tokens
    assert cache.k[0].dtype == torch.float8_e4m3fn and manager.num_free_blocks == num_pages


@pytest.mark.skipif(not importable("cuda.bindings"), reason="needs cuda-python")
@pytest.mark.parametrize("budget_gb, flags", [
    ("0.5", []),  # call 5 of the 8 that map a page under each empty row at start-up
    ("0.03", []),  # 14 pages, too few to map any at start-up: call 5 admits the fifth request
    ("0.5", ["--sync-mapping"]),  # call 5 admits the fifth request, in the loop
    ("0.5", None),  # the lesson's loop (no engine flag): the same, kernel by kernel
], ids=["ahead-at-start-up", "ahead-in-the-run", "sync", "lesson"])
def test_a_failing_driver_call_ends_the_virtual_script_in_one_paragraph(budget_gb, flags,
                                                                        monkeypatch, capsys):
    from engine.run import command_line
    from llama3_virtual import VirtualKVCache
    from virtual_pages import check, driver
    real_map, calls = VirtualKVCache.map, []

    def failing_map(self, *args):
        calls.append(args)
        if len(calls) == 5:
            check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")  # as a failed call
        real_map(self, *args)
    monkeypatch.setattr(VirtualKVCache, "map", failing_map)
    with pytest.raises(SystemExit) as exit:
        # A small pool: a cache the failed run leaves behind holds its pages until collected.
        command_line("llama3_virtual.py", ["8", "--random-weights", "--model", "tiny",
                                            "--kv-budget-gb", budget_gb,
                                            *(["--eager", *flags] if flags is not None else [])])
    err = capsys.readouterr().err
    assert exit.value.code == 3 and "CUDA_ERROR_INVALID_VALUE" in err and "Traceback" not in err
    assert len(calls) == 5  # nothing mapped after the failure


@pytest.mark.parametrize("attention", ["flash", "triton"])
@pytest.mark.parametrize("cached, second_fresh", [(0, True), (1, False), (255, False), (256, False),
                                                  (700, False), (1, True), (256, True)])
def test_prefill_after_a_cached_prefix_matches_the_reference(attention, cached, second_fresh):
    # Three prompts whose first `cached` tokens (capped below each length) are in the pool; with
    # second_fresh, the second has none cached (Triton computes such prompts apart).
    g = torch.Generator(device="cuda").manual_seed(cached)
    block_size = 256 if attention == "flash" else 16
    lengths = [cached + 5, cached + 300, max(cached, 1) + 1]
    starts = [min(cached, n - 1) for n in lengths]
    if second_fresh:
        starts[1] = 0
    max_blocks = math.ceil(max(lengths) / block_size)
    num_blocks = 3 * max_blocks + 5
    table = torch.randperm(num_blocks, device="cuda", generator=g)[:3 * max_blocks].view(3, -1).int()
    keys = torch.randn(num_blocks, block_size, 8, 128, device="cuda", generator=g).bfloat16()
    values = torch.randn(num_blocks, block_size, 8, 128, device="cuda", generator=g).bfloat16()
    new = [n - s for n, s in zip(lengths, starts)]
    q_bounds = [0] + torch.tensor(new).cumsum(0).tolist()
    k_bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    q = torch.randn(q_bounds[-1], 32, 128, device="cuda", generator=g).bfloat16()
    to_cuda = lambda b: torch.tensor(b, dtype=torch.int32, device="cuda")
    slots = torch.cat([table[r, torch.arange(s, n, device="cuda") // block_size] * block_size
                       + torch.arange(s, n, device="cuda") % block_size
                       for r, (s, n) in enumerate(zip(starts, lengths))]).long()  # the new tokens'
    info = AttentionMetadata(Phase.AFTER_PREFIX, slots, to_cuda(q_bounds), q_bounds, max(new),
                             block_table=table, cu_seqlens_k=to_cuda(k_bounds),
                             cu_seqlens_k_host=k_bounds, max_seqlen_k=max(lengths))
    backend = FlashAttentionAfterPrefix() if attention == "flash" else TritonAttention()
    out = backend.prefill_after_prefix(q, keys, values, info)
    reference = TorchAttentionAfterPrefix().prefill_after_prefix(q.double(), keys.double(), values.double(), info)
    assert relative_error(out, reference) < 2e-2


def prompts_after_a_system_prompt(n, generator, system_tokens=600):
    system = torch.randint(0, 128_000, (system_tokens,), generator=generator).tolist()
    return [system + p for p in random_prompts(n, generator)]


@pytest.mark.parametrize("attention, block_size", [("flash", 256), ("triton", 16)])
def test_forks_and_a_cached_system_prompt_give_the_tokens_of_no_sharing(attention, block_size):
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=6)
    g = torch.Generator().manual_seed(6)
    prompts = prompts_after_a_system_prompt(6, g)
    budgets = torch.randint(1, 30, (6,), generator=g).tolist()
    backend = FlashAttentionAfterPrefix if attention == "flash" else TritonAttention
    kw = dict(num_blocks=4096 // block_size * 16, block_size=block_size, attention=backend,
              graphs=True, samples=3, continuous=True, max_running=9)  # three prompts at a time
    unshared = generate_on_gpu(model, prompts, budgets, **kw)
    shared = generate_on_gpu(model, prompts, budgets, share=True, **kw)
    assert sum(shared.first_cached_tokens) >= 3 * (600 // block_size) * block_size
    assert shared.output_tokens == unshared.output_tokens
    assert all(shared.output_tokens[3 * i] == shared.output_tokens[3 * i + k]
               for i in range(6) for k in (1, 2)), "greedy samples of one prompt are equal"


def test_sampling_draws_the_same_tokens_with_and_without_sharing_on_the_gpu():
    # In float64, so with the reference attention: flash-attn and the Triton kernel compute in
    # bf16/fp16 and float32. Sampling turns any rounding difference into another token, and the
    # runs compute the prompts in different batches (forks prefill a prompt once, copies K
    # times; cached prefixes are read back, not recomputed), which round apart in lower precision.
    model = random_model(Llama, "tiny", "cuda", torch.float64, MAX_SEQ_LEN, seed=7)
    g = torch.Generator().manual_seed(7)
    prompts = prompts_after_a_system_prompt(4, g, system_tokens=100)
    budgets = [20] * 4
    kw = dict(num_blocks=1024, block_size=16, attention=TorchAttentionAfterPrefix, samples=3,
              sampler=sampler(temperature=1.0, top_p=0.95, seed=3))
    unshared = generate_on_gpu(model, prompts, budgets, **kw)
    shared = generate_on_gpu(model, prompts, budgets, share=True, continuous=True, max_running=6,
                             **kw)
    assert shared.num_copied_blocks > 0 and sum(shared.first_cached_tokens) > 0
    assert len({tuple(t) for t in shared.output_tokens}) == 12, "every sample its own tokens"
    assert shared.output_tokens == unshared.output_tokens


@pytest.mark.parametrize("top_k", [0, 40])
def test_a_row_draws_the_same_token_alone_and_beside_any_rows_on_the_gpu(top_k):
    # On CUDA a reduction's order of additions can depend on how many rows it reduces; a draw
    # must not: a served request gives the same tokens whoever runs beside it.
    g = torch.Generator(device="cuda").manual_seed(top_k)
    rows, vocab = 256, 128_256
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4  # [rows, vocab]
    every = lambda value, dtype=torch.float32: torch.full((rows,), value, dtype=dtype,
                                                          device="cuda")
    params = [every(0.8), every(0.9), every(top_k, torch.long), every(5, torch.long),
              torch.arange(rows, device="cuda"), every(17, torch.long)]
    together = draw(logits, *params)
    alone = [draw(logits[i:i + 1], *(p[i:i + 1] for p in params)).item() for i in range(rows)]
    halves = [draw(logits[part], *(p[part] for p in params))
              for part in (slice(0, rows // 2), slice(rows // 2, rows))]
    assert len(set(together.tolist())) > rows // 2, "the rows' draws should differ"
    assert together.tolist() == alone == torch.cat(halves).tolist()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]


def tokens_of_run(launcher: list[str], argv: list[str], out) -> list:
    """A script's tokens, run in processes of its own. What this test process still holds on the
    GPU (the suite's models, graphs and allocator cache) goes back first: the scripts size their
    KV budget by the card, and on an 80 GB card the rest did not fit beside it."""
    gc.collect()
    torch.cuda.empty_cache()
    done = subprocess.run([*launcher, *argv, "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [r["output_tokens"] for r in json.loads(out.read_text())["requests"]], done.stdout


@needs_triton
@pytest.mark.skipif(not importable("cuda.bindings"), reason="needs cuda-python")
def test_the_virtual_script_gives_the_paged_scripts_tokens_with_an_fp8_cache(tmp_path):
    argv = ["16", "--random-weights", "--model", "1b", "--kv-cache-dtype", "fp8"]
    paged, _ = tokens_of_run([sys.executable], ["llama3_paged.py", *argv], tmp_path / "p.json")
    virtual, stdout = tokens_of_run([sys.executable], ["llama3_virtual.py", *argv],
                                    tmp_path / "v.json")
    assert virtual == paged and sum(map(len, paged)) > 16
    assert "16 KiB per token" in stdout  # 1b's 32 KiB in bf16, halved


TP_RUN = ["49", "--random-weights", "--model", "1b"]


@pytest.mark.parametrize("script", ["llama3_paged.py", "llama3_naive.py"])
def test_two_processes_sharing_the_gpu_give_the_one_process_tokens_in_float32(script, tmp_path):
    """In float32 (the PyTorch attention: flash-attn reads bf16) the all-reduced partial sums
    round too little to change a token; two processes share the GPU over gloo."""
    argv = [script, *TP_RUN, "--dtype", "fp32"]
    one, _ = tokens_of_run([sys.executable], argv, tmp_path / "one.json")
    # one GPU visible however many the machine has (with two, each process would take its own)
    one_gpu = ["env", "CUDA_VISIBLE_DEVICES=0", *TORCHRUN, "2"]
    two, stdout = tokens_of_run(one_gpu, argv, tmp_path / "two.json")
    assert two == one
    assert "Tensor parallel over 2 processes (gloo, sharing one GPU)" in stdout


def test_two_processes_give_the_same_tokens_through_the_three_caches_with_flash_attn(tmp_path):
    """bf16, flash-attn with 4 of the 8 K/V heads in each process: naive == paged == virtual, as
    in one process (bf16 partial sums round otherwise than one process's whole sums, so the
    tokens are held to each other, not to the one-process run's)."""
    runs = {script: tokens_of_run([*TORCHRUN, "2"], [script, *TP_RUN], tmp_path / f"{script}.json")
            for script in ("llama3_paged.py", "llama3_naive.py", "llama3_virtual.py")}
    tokens = [t for t, _ in runs.values()]
    assert tokens[0] == tokens[1] == tokens[2] and sum(map(len, tokens[0])) > 49
    assert all("4 of 8 K/V heads" in stdout for _, stdout in runs.values())


def test_nccl_collectives_captured_in_cuda_graphs_give_the_one_process_tokens(tmp_path):
    """One process under torchrun: NCCL, its all-reduces inside the decode step's graphs, and
    sums over one rank that change nothing: the tokens of one process with graphs, bf16."""
    argv = ["llama3_paged.py", *TP_RUN]
    one, _ = tokens_of_run([sys.executable], [*argv, "--no-compile"], tmp_path / "one.json")
    nccl, stdout = tokens_of_run([*TORCHRUN, "1"], argv, tmp_path / "nccl.json")
    assert nccl == one
    assert "Captured" in stdout and "(nccl, each on a GPU of its own)" in stdout


def test_beams_sharing_blocks_on_the_gpu_find_the_unshared_beams_and_recompile_nothing(tmp_path):
    """The script's default GPU path (compiled layers, CUDA graphs, flash-attn, bf16): beams that
    share their prompt's blocks, copied on write, find the beams that each hold their own, in
    the same batches. beam_search drives the engine itself, in inference mode as the graphs were
    captured: a step in grad mode would recompile every compiled layer (dynamo's grad_mode guard)."""
    beams, logs = {}, {}
    for name, extra in [("shared", []), ("unshared", ["--no-sharing"])]:
        gc.collect()
        torch.cuda.empty_cache()
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, "llama3_paged.py", "8", "--random-weights", "--model",
                               "1b", "--beam-width", "4", "--json", str(out), *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TORCH_LOGS": "recompiles"})
        assert done.returncode == 0, done.stderr[-3000:]
        beams[name], logs[name] = json.loads(out.read_text())["beams"], done.stdout + done.stderr
    tokens = {name: [[b["output_tokens"] for b in p] for p in found] for name, found in beams.items()}
    assert tokens["shared"] == tokens["unshared"] and len(tokens["shared"]) == 8
    assert "Captured" in logs["shared"] and "% saved" in logs["shared"]
    assert not any("grad_mode" in log for log in logs.values())


@pytest.mark.parametrize("eager", [True, False])  # False: CUDA graphs, prefill's too
def test_launching_a_prefill_never_waits_for_the_gpu(eager):
    """With overlapped steps a new request's prefill is launched while the decode step before it
    runs. Anything in the launch that waited for the GPU (a copy from pageable memory, .item(),
    .tolist() of a device tensor) would put that step's rest on the request's time to first
    token (docs/serving-under-load.md: launching a short prefill took the host 14-21 ms on an
    H100). CUDA's sync debug mode raises at any such wait."""
    from engine.llm import SamplingParams
    from engine.llm_engine import LLMEngine
    # A small pool: the tests after this one size theirs from the GPU memory it leaves
    engine = LLMEngine("paged", 4, model="tiny", random_weights=True, eager=eager, kv_budget_gb=1)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # its prefill recorded, its first decode step in flight
    engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    step = engine.scheduler.schedule()
    assert step.kind == "prefill" and engine.core.in_flight is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():  # as LLMEngine.step launches it
            engine.runner.launch(step, engine.scheduler)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_adding_a_request_never_waits_for_the_gpu():
    """A request's sampling parameters and last token go to the device as queued copies: with
    overlapped steps one is added while a step runs, and a synchronous copy would wait for it
    (engine/sampler.py's RowSampler.set_row). CUDA's sync debug mode raises at any such wait."""
    from engine.llm import SamplingParams
    from engine.llm_engine import LLMEngine
    engine = LLMEngine("paged", 4, model="tiny", random_weights=True, eager=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    row = 0  # the request's, now free again; its parameters are still in place
    assert engine.sampler.temperature[row].item() == pytest.approx(0.7)
    assert engine.sampler.top_k[row].item() == 5 and engine.sampler.seed[row].item() == 1


def test_logprobs_from_cuda_graphs_are_the_eager_steps_and_change_no_token():
    """features/logprobs/logprobs.py's decode step as CUDA graphs (a second set, beside the plain one)
    against the same step kernel by kernel; both against a run that asks for none."""
    from engine.llm import LLM, SamplingParams
    options = dict(model="tiny", random_weights=True, compile=False, kv_budget_gb=1,
                   max_num_seqs=8)
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 17)]
    asked = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5,
                           prompt_logprobs=2)
    runs = {}
    for eager in (False, True):
        llm = LLM(**options, eager=eager)
        assert (llm.llm_engine.runner.logprobs.graphs is None) == eager
        runs[eager] = llm.generate(prompts, asked, use_tqdm=False)
        plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in runs[eager]] == [
            o.outputs[0].token_ids for o in plain]
        del llm
        torch.cuda.empty_cache()
    compared = 0
    for graphed, eager in zip(runs[False], runs[True]):  # until bf16's rounding (the graphs'
        for a, b in zip(graphed.outputs[0].logprobs, eager.outputs[0].logprobs):  # padded
            if list(a)[0] != list(b)[0]:  # batches) picks another token at a near-tie
                break
            assert {i: p.rank for i, p in a.items() if p.rank <= 3} == {
                i: p.rank for i, p in b.items() if p.rank <= 3}
            assert [p.logprob for p in a.values()][:1] == pytest.approx(
                [p.logprob for p in b.values()][:1], abs=2e-2)  # bf16 logits
            compared += 1
    assert compared >= 18, compared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_logprobs_kernel_matches_float64(dtype):
    """features/logprobs/kernel.py's one-read log-sum-exp, log-probability and rank against
    PyTorch's in float64, over a vocabulary that is no multiple of its tile."""
    from features.logprobs.kernel import row_stats
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(37, 128_256 + 5, device="cuda", generator=g) * 4).to(dtype)
    tokens = torch.randint(0, logits.shape[1], (37,), device="cuda", generator=g)
    tokens[0] = logits[0].argmax()  # rank 1
    got = row_stats(logits, tokens)
    exact = logits.double()
    total = torch.logsumexp(exact, -1)
    chosen = exact.gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(got[:, 0].double(), total, atol=1e-4, rtol=0)
    assert torch.allclose(got[:, 1].double(), chosen - total, atol=1e-4, rtol=0)
    assert got[:, 2].long().tolist() == ((exact > chosen[:, None]).sum(-1) + 1).tolist()
    assert got[0, 2].item() == 1


def test_penalties_with_graphs_and_overlapped_steps_are_the_plain_eager_runs():
    """engine/sampler.py's RowProcessing counts each row's tokens on the device, as they are
    drawn: with overlapped steps the host learns a token a step late. Against the same requests
    kernel by kernel without overlap; the rows that ask for nothing still replay the graphs and
    give the tokens of a run where nobody asks."""
    from engine.llm import LLM, SamplingParams
    options = dict(model="tiny", random_weights=True, compile=False, kv_budget_gb=1,
                   max_num_seqs=8)
    prompts = [[7, 7, 7, 9000, 12, 12, 5, 5, 5, 1], list(range(2000, 2033)), [100, 101, 102]]
    penalized = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, min_tokens=3,
                               logit_bias={7: 5.0, 12: 4.5, 2001: 5.0, 300: 4.0},
                               repetition_penalty=1.3, frequency_penalty=0.7,
                               presence_penalty=0.4)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, min_p=0.5, seed=2, ignore_eos=True)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for fast in (True, False):
        llm = LLM(**options, eager=not fast, overlap=fast)
        alone = llm.generate(prompts, plain, use_tqdm=False)
        mixed = llm.generate(prompts * 3, [penalized] * 3 + [sampled] * 3 + [plain] * 3,
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[6:]] == [
            o.outputs[0].token_ids for o in alone]
        runs[fast] = [o.outputs[0].token_ids for o in mixed]
        del llm
        torch.cuda.empty_cache()
    assert runs[True] == runs[False]


@pytest.mark.parametrize("tokens", [1, 7, 64, 129, 256, 257, 1000])
@pytest.mark.parametrize("n_in, n_out", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
                                         (2048, 2048), (8192, 2048)])
def test_scaled_mm_of_fp8_weights_is_the_dequantize_then_matmul_reference(tokens, n_in, n_out):
    # 8B's projections (q/k/v, o, gate/up, down) and 1B's o and down at decode and prefill
    # sizes: torch._scaled_mm (float8 tensor cores, float32 sums, bf16 out; up to 256 rows with
    # unit scales and the rows' scales after, above that row-wise) against the same float8
    # numbers multiplied in float32. The bound is bf16's rounding of the output (2^-8 relative)
    # with room for the order of the sums.
    from features.fp8.weights import Float8Linear, quantize_rows, reference_matmul
    g = torch.Generator(device="cuda").manual_seed(tokens + n_in + n_out)
    linear = torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16, device="cuda")
    linear.requires_grad_(False).weight.normal_(0, n_in ** -0.5, generator=g)
    fp8 = Float8Linear(linear)
    assert fp8.uses_scaled_mm
    x = torch.randn(tokens, n_in, dtype=torch.bfloat16, device="cuda", generator=g)
    got = fp8(x)
    expected = reference_matmul(*quantize_rows(x), fp8.weight, fp8.scale)
    error = relative_error(got, expected)
    print(f"tokens {tokens}, {n_in} -> {n_out}: relative error {error:.2e}")
    assert got.dtype == torch.bfloat16 and error < 4e-3


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 256, 1000])
@pytest.mark.parametrize("ffn_dim", [14336, 8192])  # 8B's, 1B's
def test_swiglu_quantize_is_the_float32_product_quantized_per_token(rows, ffn_dim, scaled):
    # features/fp8/swiglu_quantize.py, one kernel, against silu(gate) * up in float32 quantized
    # by quantize_rows: the same scales, and the same float8 numbers but where the sigmoid's
    # last bit moves a product across a rounding boundary (one step of e4m3 for that number).
    # scaled: gate/up's sums with unit scales, which the kernel multiplies by the token's scale
    # and each column's first, as Float8FeedForward hands them over.
    import torch.nn.functional as F
    from features.fp8.swiglu_quantize import swiglu_quantize
    from features.fp8.weights import quantize_rows
    g = torch.Generator(device="cuda").manual_seed(rows + ffn_dim)
    sizes = torch.logspace(-2, 1, rows, device="cuda")[:, None]  # rows of very different sizes
    gate_up = (torch.randn(rows, 2 * ffn_dim, device="cuda", generator=g) * sizes).bfloat16()
    if scaled:  # sums of float8 products are hundreds to thousands; the scales make them small
        row_scale = torch.rand(rows, 1, device="cuda", generator=g) * 1e-3 + 1e-4
        column_scale = torch.rand(1, 2 * ffn_dim, device="cuda", generator=g) * 1e-2 + 1e-3
        sums = (gate_up.float() / row_scale / column_scale).bfloat16()
        h8, scale = swiglu_quantize(sums, row_scale, column_scale)
        gate, up = (sums.float() * row_scale * column_scale).chunk(2, dim=-1)
    else:
        h8, scale = swiglu_quantize(gate_up)
        gate, up = gate_up.float().chunk(2, dim=-1)
    expected8, expected_scale = quantize_rows(F.silu(gate) * up)
    assert h8.dtype == expected8.dtype and h8.shape == (rows, ffn_dim)
    assert torch.allclose(scale, expected_scale, rtol=1e-6, atol=0)
    same = (h8.float() == expected8.float()).float().mean().item()
    error = relative_error(h8.float() * scale, expected8.float() * expected_scale)
    print(f"{rows} rows of {ffn_dim}: {same:.4%} of the float8 numbers the same, relative "
          f"error {error:.1e}")
    assert same > 0.999 and error < 1e-3


@pytest.mark.parametrize("rows", [1, 64, 200, 256, 1000])
def test_the_fp8_feed_forward_is_the_dequantize_then_matmul_reference(rows):
    # Float8FeedForward with 8B's shapes, each of its paths: gate/up through cuBLAS's unit-scale
    # kernel with its scales in the SwiGLU kernel up to 256 rows, row-wise above; down split over
    # K, with its scales after, or row-wise. Against the same float8 weights multiplied in
    # float32 and SwiGLU in float32. The bound: down's float8 input comes from gate/up's bf16
    # output here, from float32 there, so a number near a rounding boundary moves one step of
    # e4m3; the two paths emulated on the CPU (_scaled_mm's CPU kernel) erred 1.4e-2 to 1.6e-2.
    import torch.nn.functional as F
    from features.fp8.weights import (Float8FeedForward, Float8Linear, quantize_rows,
                                      reference_matmul)
    g = torch.Generator(device="cuda").manual_seed(rows)
    gate_up, down = (torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16, device="cuda")
                     for n_in, n_out in ((4096, 2 * 14336), (14336, 4096)))
    for linear in (gate_up, down):
        linear.requires_grad_(False).weight.normal_(0, linear.in_features ** -0.5, generator=g)
    feed_forward = Float8FeedForward(Float8Linear(gate_up), Float8Linear(down))
    sizes = torch.logspace(-1, 1, rows, device="cuda")[:, None]  # tokens of different sizes
    x = (torch.randn(rows, 4096, device="cuda", generator=g) * sizes).bfloat16()
    w_gate_up, w_down = feed_forward.w_gate_up, feed_forward.w_down
    gate, up = reference_matmul(*quantize_rows(x), w_gate_up.weight, w_gate_up.scale).chunk(2, -1)
    expected = reference_matmul(*quantize_rows(F.silu(gate) * up), w_down.weight, w_down.scale)
    got = feed_forward(x)
    error = relative_error(got, expected)
    print(f"{rows} rows: relative error {error:.2e}")
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 4096) and error < 3e-2


def test_fp8_weights_with_cuda_graphs_and_overlapped_steps_give_the_eager_tokens_in_bfloat16():
    # The same _scaled_mm kernels kernel by kernel and replayed from graphs (batches padded to
    # their bucket), steps overlapped, requests preempted: the same tokens, even in bf16.
    from features.fp8.weights import quantize_weights
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=9)
    quantize_weights(model)
    prompts, budgets = prompts_and_budgets(12, seed=9, most_tokens=40)
    kw = {"num_blocks": 64, "block_size": 256}
    eager = generate_on_gpu(model, prompts, budgets, **kw)
    fast = generate_on_gpu(model, prompts, budgets, graphs=True, overlap=True, continuous=True,
                           max_running=5, **kw)
    assert fast.output_tokens == eager.output_tokens


def test_fp8_weights_through_compiled_layers_err_from_the_16_bit_model_as_eager_ones_do():
    # Compiled, the per-token quantization fuses into the kernels around each matmul. Their
    # inputs round otherwise than the eager kernels' in bf16, and an input that moves across a
    # float8 rounding boundary moves by an eighth of itself: so the compiled logits are not the
    # eager ones. What must hold is that they are as near the 16-bit model's as the eager ones
    # (a wrong scale or layout in the compiled graph would be far off).
    import copy
    from engine.model_runner import ModelForward
    from features.fp8.weights import quantize_weights
    from features.triton_attention import TritonAttention
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=10)
    fp8 = copy.deepcopy(model)
    quantize_weights(fp8)
    prompts, _ = prompts_and_budgets(6, seed=10, most_tokens=1)
    lengths = [len(p) for p in prompts]
    bounds = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    batch = PrefillBatch(cu_seqlens=bounds.int(), cu_seqlens_host=bounds.tolist(),
                         max_seqlen=max(lengths), slot_mapping=None)

    class FreshAttention:  # a prefill over its own k, v: no pool needed
        backend = TritonAttention()

        @torch.compiler.disable
        def attention(self, layer, q, k, v, batch):
            return self.backend.prefill(q, k, v, batch)

    tokens = torch.tensor([t for p in prompts for t in p], device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    logits = lambda m: m(tokens, positions, FreshAttention(), batch, logits_at=bounds[1:] - 1)
    with torch.inference_mode():
        sixteen_bit, eager = logits(model), logits(fp8)
        forward = ModelForward(fp8, compiled=True)  # runs the layers compiled, however short
        with forward.at_any_length():
            compiled = logits(forward)
    eager_error, compiled_error = relative_error(eager, sixteen_bit), relative_error(compiled,
                                                                                   sixteen_bit)
    print(f"relative error from the 16-bit logits: eager {eager_error:.3f}, compiled "
          f"{compiled_error:.3f} (compiled from eager {relative_error(compiled, eager):.3f})")
    assert compiled_error < 1.5 * eager_error + 0.01
