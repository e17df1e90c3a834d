"""Paged attention against plain dense attention over the same keys and values."""

import math

import pytest
import torch
import torch.nn.functional as F

from llama3_paged import TorchAttention
from llama3_paged import DecodeBatch


def dense_attention(q, keys, values):
    """float64 softmax(q k^T / sqrt(d)) v for one request. q: [H, d]; keys, values: [L, Hkv, d]."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double()[:, None, :] @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # [H, 1, L]
    return (F.softmax(scores, dim=-1) @ v)[:, 0]  # [H, d]


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_reference_equals_dense_attention(gqa, block_size):
    g = torch.Generator().manual_seed(gqa * 100 + block_size)
    n_kv, d, batch, num_blocks = 2, 32, 5, 64
    lengths = torch.randint(1, 70, (batch,), generator=g)
    max_blocks = math.ceil(70 / block_size)
    # A random permutation of the pool, dealt out: each request's blocks are scattered.
    pool_order = torch.randperm(num_blocks * max(1, 8 // block_size), generator=g)
    num_blocks = len(pool_order)
    table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    dealt = iter(pool_order.tolist())
    for r, n in enumerate(lengths.tolist()):
        for b in range(math.ceil(n / block_size)):
            table[r, b] = next(dealt)
    key_blocks = torch.randn(num_blocks, block_size, n_kv, d, generator=g)
    value_blocks = torch.randn(num_blocks, block_size, n_kv, d, generator=g)
    q = torch.randn(batch, n_kv * gqa, d, generator=g)
    batch_info = DecodeBatch(slot_mapping=None, block_table=table, cache_seqlens=lengths.int(),
                             max_cache_seqlen=int(lengths.max()))
    out = TorchAttention().decode(q, key_blocks, value_blocks, batch_info)
    for r, n in enumerate(lengths.tolist()):
        blocks = table[r, :math.ceil(n / block_size)].long()
        keys = key_blocks[blocks].flatten(0, 1)[:n]
        values = value_blocks[blocks].flatten(0, 1)[:n]
        torch.testing.assert_close(out[r].double(), dense_attention(q[r], keys, values),
                                   rtol=1e-5, atol=1e-5)
