"""The FP8 KV cache on the CPU: the format's error bound, the cache against a float64 reference,
and a pool that holds the tokens its bytes allow."""

import json
import math

import pytest
import torch
from test_scripts import TINY, run_script

from features.fp8_cache import FP8_MAX, HEADROOM, FP8KVCache, dequantize, quantize
from llama3_paged import DecodeBatch, PrefillBatch, TorchAttention
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
    cache.attention(0, q, k, v, PrefillBatch(slots, torch.tensor(bounds, dtype=torch.int32), bounds,
                                             max(lengths)))
    k_scale, v_scale = cache.scales[0].tolist()
    assert k_scale == pytest.approx(k.abs().max().item() * HEADROOM / FP8_MAX)
    assert cache.k.dtype == torch.float8_e4m3fn
    # decode: the last token of each request again, attending over everything cached
    last = torch.tensor([lengths[0] - 1, sum(lengths) - 1])
    table = torch.tensor(rows, dtype=torch.int32)
    batch = DecodeBatch(slots[last], table, torch.tensor(lengths, dtype=torch.int32), max(lengths))
    out = cache.attention(0, q[last], k[last], v[last], batch)
    for r in range(2):
        keys = dequantize(quantize(k[bounds[r]:bounds[r + 1]], torch.tensor(k_scale)), torch.tensor(k_scale), torch.float64)
        values = dequantize(quantize(v[bounds[r]:bounds[r + 1]], torch.tensor(v_scale)), torch.tensor(v_scale), torch.float64)
        expected = attend64(q[last[r]].double(), keys, values)
        assert (out[r].double() - expected).abs().max() < 1e-4
        exact = attend64(q[last[r]].double(), k[bounds[r]:bounds[r + 1]].double(), v[bounds[r]:bounds[r + 1]].double())
        assert (out[r].double() - exact).abs().max() < 0.1 * v.abs().max()  # and near the exact


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


def test_fp8_with_a_cached_system_prompt_is_refused_in_one_paragraph():
    out = run_script("llama3_paged.py", 2, *TINY, "--kv-cache-dtype", "fp8", "--system-prompt", "Be brief.")
    assert out.returncode == 2 and "--no-prefix-cache" in out.stderr and "Traceback" not in out.stderr
