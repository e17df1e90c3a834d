"""The FP8 KV cache on the CPU: the format's error bound, the cache against a float64 reference,
and a pool that holds the tokens its bytes allow."""

import json
import math

import pytest
import torch
from conftest import ROOT, assert_one_paragraph, engine_model, run_main
from test_scripts import TINY, run_script

from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import TorchAttentionAfterPrefix
from features.fp8.cache import FP8_MAX, HEADROOM, FP8KVCache, dequantize, quantize
from llama3_paged import TorchAttention
from block_manager import BlockManager
from plumbing.inputs import PRESETS


def test_a_round_trip_keeps_three_mantissa_bits_and_clamps_what_is_out_of_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g, dtype=torch.float64) * 3
    scale = torch.tensor(x.abs().max().item() / FP8_MAX)
    back = dequantize(quantize(x, scale), scale, torch.float64)
    normal = x.abs() >= scale * 2.0 ** -6  # e4m3's smallest normal number, scaled
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -4).all()  # half an ulp: 2^-4
    assert ((back - x).abs()[~normal] <= scale * 2.0 ** -10).all()  # subnormals: a fixed step
    big = dequantize(quantize(torch.tensor([1e9, -1e9]), scale), scale, torch.float64)
    assert big.tolist() == pytest.approx([FP8_MAX * scale.item(), -FP8_MAX * scale.item()])  # not NaN


def attend64(q, k, v):
    """One query per request over all its keys, in float64: q [H, d], k, v [n, H_kv, d]."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, d]
    scores = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


def test_the_cache_stores_scaled_float8_and_decodes_as_dequantize_then_attend():
    args, block_size, lengths = PRESETS["tiny"], 16, [5, 37]
    cache = FP8KVCache(args, 8, block_size, torch.float32, "cpu", TorchAttention())
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d = args.n_heads, args.n_kv_heads, args.head_dim
    rows = [[3, 0, 6], [1, 7, 2]]  # each request's blocks, out of order
    slots = torch.tensor([rows[r][t // block_size] * block_size + t % block_size
                          for r, n in enumerate(lengths) for t in range(n)])
    k, v = (torch.randn(sum(lengths), kv_heads, d, generator=g) * 5 for _ in range(2))
    q = torch.randn(sum(lengths), heads, d, generator=g)
    bounds = [0, lengths[0], sum(lengths)]
    cache.attention(0, q, k, v, AttentionMetadata(Phase.PREFILL, slots,
                                                  torch.tensor(bounds, dtype=torch.int32), bounds,
                                                  max(lengths)))
    k_scale, v_scale = cache.scales[0].tolist()
    assert k_scale == pytest.approx(k.abs().max().item() * HEADROOM / FP8_MAX)
    assert cache.k.dtype == torch.float8_e4m3fn
    # decode: the last token of each request again, attending over everything cached
    last = torch.tensor([lengths[0] - 1, sum(lengths) - 1])
    table = torch.tensor(rows, dtype=torch.int32)
    batch = AttentionMetadata(Phase.DECODE, slots[last], block_table=table,
                              cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                              max_cache_seqlen=max(lengths))
    out = cache.attention(0, q[last], k[last], v[last], batch)
    for r in range(2):
        keys = dequantize(quantize(k[bounds[r]:bounds[r + 1]], torch.tensor(k_scale)), torch.tensor(k_scale), torch.float64)
        values = dequantize(quantize(v[bounds[r]:bounds[r + 1]], torch.tensor(v_scale)), torch.tensor(v_scale), torch.float64)
        expected = attend64(q[last[r]].double(), keys, values)
        assert (out[r].double() - expected).abs().max() < 1e-4
        exact = attend64(q[last[r]].double(), k[bounds[r]:bounds[r + 1]].double(), v[bounds[r]:bounds[r + 1]].double())
        assert (out[r].double() - exact).abs().max() < 0.1 * v.abs().max()  # and near the exact


def test_scales_forgotten_after_a_warm_up_are_set_by_the_next_prefill_as_a_fresh_cache_sets_them():
    # The API's and the tools' warm-up passes (a token repeated) must not set the scales that
    # the requests after them are stored with: a fresh cache, given only the request, is the truth.
    args = PRESETS["tiny"]
    g = torch.Generator().manual_seed(2)
    shape = (8, args.n_kv_heads, args.head_dim)
    warm_k, warm_v = (torch.full(shape, 0.01) for _ in range(2))
    k, v = (torch.randn(*shape, generator=g) * 7 for _ in range(2))
    q = torch.randn(8, args.n_heads, args.head_dim, generator=g)
    batch = AttentionMetadata(Phase.PREFILL, torch.arange(8),
                              torch.tensor([0, 8], dtype=torch.int32), [0, 8], 8)
    warmed, fresh = (FP8KVCache(args, 4, 16, torch.float32, "cpu", TorchAttention()) for _ in range(2))
    warmed.attention(0, q, warm_k, warm_v, batch)
    warmed.forget_scales()
    assert warmed.scales.eq(1).all() and not any(warmed.scaled)
    for cache in (warmed, fresh):
        cache.attention(0, q, k, v, batch)
    assert torch.equal(warmed.scales, fresh.scales) and warmed.scaled[0]
    assert torch.equal(warmed.k[0, :8].view(torch.uint8), fresh.k[0, :8].view(torch.uint8))


def test_an_fp8_pool_holds_four_times_the_float32_tokens_and_says_so(tmp_path):
    records = {}
    for dtype in ["auto", "fp8"]:
        out = run_script("llama3_paged.py", 3, *TINY, "--max-new-tokens", 4, "--kv-cache-dtype", dtype,
                         "--json", tmp_path / f"{dtype}.json")
        assert out.returncode == 0, out.stderr
        records[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["memory"]
    assert records["fp8"]["kv_bytes_per_token"] * 4 == records["auto"]["kv_bytes_per_token"]
    blocks = {d: r["kv_pool_bytes"] / r["kv_bytes_per_token"] for d, r in records.items()}
    assert blocks["fp8"] == pytest.approx(4 * blocks["auto"], rel=1e-3)
    assert "512 bytes per token" in out.stdout


class FakeTritonDecode(TorchAttention):
    """A Triton backend's shape on the CPU: `paged_decode` over float8 blocks with their scales,
    written here as gather, dequantize and attend in float64."""

    name = "triton"

    @staticmethod
    def paged_decode(q, key_blocks, value_blocks, block_table, cache_seqlens, kv_scales):
        out = []
        for r, n in enumerate(cache_seqlens.tolist()):
            blocks = block_table[r, :math.ceil(n / key_blocks.shape[1])]
            k, v = (dequantize(b[blocks].flatten(0, 1)[:n], scale, torch.float64)
                    for b, scale in zip((key_blocks, value_blocks), kv_scales))
            out.append(attend64(q[r].double(), k, v))
        return torch.stack(out).to(q.dtype)


def test_a_decode_step_hands_a_triton_backend_the_layers_float8_blocks_table_and_scales():
    # Two layers, so that the scales and blocks must be the layer's own; the truth quantizes the
    # K/V as the cache does and attends in float64.
    args, block_size, lengths = PRESETS["tiny"], 16, [7, 21]
    cache = FP8KVCache(args, 6, block_size, torch.float32, "cpu", FakeTritonDecode())
    g = torch.Generator().manual_seed(3)
    rows = [[4, 1], [0, 5]]
    slots = torch.tensor([rows[r][t // block_size] * block_size + t % block_size
                          for r, n in enumerate(lengths) for t in range(n)])
    bounds = [0, lengths[0], sum(lengths)]
    prefill = AttentionMetadata(Phase.PREFILL, slots, torch.tensor(bounds, dtype=torch.int32),
                                bounds, max(lengths))
    kv = {}
    for layer, spread in ((0, 1.0), (1, 7.0)):
        k, v = (torch.randn(sum(lengths), args.n_kv_heads, args.head_dim, generator=g) * spread
                for _ in range(2))
        cache.attention(layer, torch.randn(sum(lengths), args.n_heads, args.head_dim, generator=g),
                        k, v, prefill)
        kv[layer] = k, v
    q = torch.randn(2, args.n_heads, args.head_dim, generator=g)
    batch = AttentionMetadata(Phase.DECODE, None, block_table=torch.tensor(rows, dtype=torch.int32),
                              cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                              max_cache_seqlen=max(lengths))
    out = cache.decode_attention(1, q, batch)
    k_scale, v_scale = (torch.tensor(x.abs().max().item() * HEADROOM / FP8_MAX) for x in kv[1])
    for r in range(2):
        part = slice(bounds[r], bounds[r + 1])
        keys, values = (dequantize(quantize(x[part], scale), scale, torch.float64)
                        for x, scale in ((kv[1][0], k_scale), (kv[1][1], v_scale)))
        assert (out[r].double() - attend64(q[r].double(), keys, values)).abs().max() < 1e-4


def outputs_after_a_cached_prefix(attention, device, dtype, block_size: int):
    """A prefill after a cached prefix through an FP8 cache, and its truth in float64. Prompt 0
    begins with block_size + 4 cached tokens (in blocks 5 and 2) and brings 9 new ones; prompt 1
    brings 6, nothing cached. The truth: the cached part as float8 stored it, the new tokens' K/V
    as computed, each new token seeing every key up to its own position. Returns [T, H, d]
    twice: the cache's output and the truth's. (tests/test_gpu.py runs it with flash-attn.)"""
    args = PRESETS["tiny"]
    cache = FP8KVCache(args, 8, block_size, dtype, device, attention)
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d = args.n_heads, args.n_kv_heads, args.head_dim
    tables, cached, new = [[5, 2], [7, 0]], [block_size + 4, 0], [9, 6]
    lengths = [c + n for c, n in zip(cached, new)]
    slot = lambda r, p: tables[r][p // block_size] * block_size + p % block_size
    on = lambda *tensors: [t.to(device) for t in tensors]
    random = lambda n, h, scale=5.0: (torch.randn(n, h, d, generator=g, dtype=torch.float64) * scale)
    prefix_k, prefix_v, k, v = (random(n, kv_heads) for n in (cached[0], cached[0], sum(new), sum(new)))
    q = random(sum(new), heads, 1.0)
    # The prefix's own prefill: it sets the layer's scales and stores the prefix.
    cache.attention(0, *on(random(cached[0], heads).to(dtype), prefix_k.to(dtype), prefix_v.to(dtype)),
                    AttentionMetadata(Phase.PREFILL,
                                      *on(torch.tensor([slot(0, p) for p in range(cached[0])]),
                                          torch.tensor([0, cached[0]], dtype=torch.int32)),
                                      [0, cached[0]], cached[0]))
    bounds, bounds_k = [0, new[0], sum(new)], [0, lengths[0], sum(lengths)]
    slots = torch.tensor([slot(r, p) for r in range(2) for p in range(cached[r], lengths[r])])
    table, cu_seqlens_k = on(torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(bounds_k, dtype=torch.int32))
    batch = AttentionMetadata(
        Phase.AFTER_PREFIX, *on(slots, torch.tensor(bounds, dtype=torch.int32)), bounds, max(new),
        block_table=table, cu_seqlens_k=cu_seqlens_k, cu_seqlens_k_host=bounds_k,
        max_seqlen_k=max(lengths))
    out = cache.attention(0, *on(q.to(dtype), k.to(dtype), v.to(dtype)), batch)
    k_scale, v_scale = (cache.scales[0, i].cpu() for i in range(2))
    stored = lambda x, scale: dequantize(quantize(x.to(dtype).cpu(), scale), scale, torch.float64)
    fresh = lambda x: x.to(dtype).double()  # as the model computed them, in its dtype
    keys = [torch.cat([stored(prefix_k, k_scale), fresh(k[:new[0]])]), fresh(k[new[0]:])]
    values = [torch.cat([stored(prefix_v, v_scale), fresh(v[:new[0]])]), fresh(v[new[0]:])]
    expected = torch.stack([attend64(fresh(q[bounds[r] + i]), keys[r][:cached[r] + i + 1],
                                     values[r][:cached[r] + i + 1])
                            for r in range(2) for i in range(new[r])])
    return out.cpu().double(), expected


def test_a_prompt_after_a_cached_prefix_attends_as_dequantize_then_attend_with_its_own_fresh_kv():
    out, expected = outputs_after_a_cached_prefix(TorchAttentionAfterPrefix(), "cpu", torch.float32,
                                                  block_size=16)
    assert (out - expected).abs().max() < 1e-4


# slow: 9 s of script runs; the attention after a float8 prefix is checked in-process above
@pytest.mark.slow
def test_a_cached_system_prompt_is_read_from_float8_blocks_and_the_first_prompt_computes_it(tmp_path):
    # The first prompt computes the system prompt, the others find its blocks: the first's
    # tokens are the run's without the prefix cache, where every prompt computes it.
    runs, printed = {}, {}
    for flags in [[], ["--no-prefix-cache"]]:
        out = run_script("llama3_paged.py", 4, *TINY, "--dtype", "fp32", "--kv-cache-dtype", "fp8",
                         "--system-prompt-file", ROOT / "system_prompt.txt", "--max-new-tokens", 8,
                         *flags, "--json", tmp_path / "run.json")
        assert out.returncode == 0, out.stderr
        runs[bool(flags)] = json.loads((tmp_path / "run.json").read_text())
        printed[bool(flags)] = out.stdout
    assert runs[False]["sharing"]["system_prompt_hit_percent"] == pytest.approx(75.0)  # 3 of 4
    assert "Cascade attention: off (the FP8 cache" in printed[False]  # it reads 16-bit blocks
    tokens = {k: [r["output_tokens"] for r in run["requests"]] for k, run in runs.items()}
    assert tokens[False][0] == tokens[True][0]


@pytest.mark.parametrize("flags, message", [
    (["--continuous", "--max-batched-tokens", "64"], "each mixed step would copy"),
    (["--system-prompt", "Be brief.", "--cascade", "on"], "16-bit blocks"),
])
def test_what_the_fp8_cache_does_not_serve_yet_is_refused_in_one_paragraph(flags, message,
                                                                          capsys):
    from engine.run import command_line  # the script's run, in this process
    code, _, err = run_main(lambda argv: command_line("llama3_paged.py", argv),
                            ["2", *TINY, "--kv-cache-dtype", "fp8", *flags], capsys)
    assert_one_paragraph(code, err, 2, message)


@pytest.mark.parametrize("name, chosen", [("auto", "auto"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")])
def test_vllms_names_for_the_kv_cache_dtype_choose_ours(name, chosen):
    from engine.config import parse_script_arguments
    args = parse_script_arguments("paged", ["4", "--random-weights", "--kv-cache-dtype", name])
    assert args.kv_cache_dtype == chosen


def test_fp8_e5m2_is_refused_by_name():
    from engine.config import Config
    from plumbing.cli import UserError
    with pytest.raises(UserError, match="fp8_e5m2 is not built"):
        Config.from_options("paged", {"kv_cache_dtype": "fp8_e5m2"})  # LLM(kv_cache_dtype=...)


def test_fp8_blocks_swapped_out_and_back_give_the_recomputed_tokens():
    # Six requests growing by 40 tokens in a pool of 12 blocks of 16: some are preempted. The
    # truth is recomputing them, not the run without preemption: scales come from the first
    # prefill, which a larger pool fills with other prompts (16 ShareGPT requests on the tiny
    # model, 100 blocks against 2,000: other tokens on 13 of the 16; docs/fp8.md).
    from conftest import generate
    model = engine_model(11, torch.float32, 256)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 12, 3, 9, 14, 7)]

    def run(swap_blocks: int):
        cache = FP8KVCache(model.args, 12, 16, torch.float32, "cpu", TorchAttentionAfterPrefix())
        manager = BlockManager(12, 16, len(prompts), 256 // 16)
        return generate(model, cache, manager, prompts, [40] * 6, 256, continuous=True,
                        chunk_tokens=8192, swap_blocks=swap_blocks)
    swapped, recomputed = run(swap_blocks=8), run(swap_blocks=0)
    assert swapped.scheduler.num_swapped > 0 and recomputed.scheduler.num_preemptions > 0
    assert swapped.output_tokens == recomputed.output_tokens
