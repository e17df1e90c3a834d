"""Paged attention for one new token per request, in Triton: what flash-attn does with a block table.

One program handles one request and one KV head. It walks the request's row of the block table,
loads the keys and values a tile of tokens at a time from wherever their blocks sit in the pool,
and keeps an online softmax: the running maximum score `m`, the running denominator `l` and the
running weighted sum of values `acc`, rescaled by exp(m_old - m_new) whenever the maximum grows.
So every cached K and V is read once, and the scores never leave the chip. The query heads that
share the KV head (GQA) are handled together, so one read of a block serves all of them.

More in docs/engine-notes.md.
"""

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import FlashAttentionAfterPrefix, attend_after_prefix
from block_manager import to_device

TOKENS_PER_TILE = 128  # tokens loaded per loop step, whatever the block size: a tile of 128
                       # tokens spans eight blocks of 16, or half a block of 256
NUM_WARPS = 4  # with tiles of 128: within 2% of the fastest at W's, W2's and N's typical steps;
               # tiles of 64 in 2 warps win at W2's first, widest steps only (docs/fp8.md)
# Float8 tiles are half the bytes, and the kernel's time goes to its arithmetic more than to its
# loads (docs/fp8.md): the smallest programs, a tile of 32 tokens in one warp, many on each SM at
# once, hide it best: the fastest of tiles of 16 to 128 and 1 to 8 warps at W's, W2's and N's
# lengths (tools/decode_kernel_cost.py).
FP8_TOKENS_PER_TILE, FP8_NUM_WARPS = 32, 1


@triton.jit
def paged_decode_kernel(
        q_ptr, key_blocks_ptr, value_blocks_ptr, block_table_ptr, cache_seqlens_ptr, out_ptr,
        kv_scales_ptr, scale, q_stride_request, q_stride_head, kv_stride_block, kv_stride_slot,
        kv_stride_head, table_stride_request, out_stride_request, out_stride_head,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PADDED: tl.constexpr, TILE: tl.constexpr, FP8: tl.constexpr):
    # Programs start in this order: a request's K/V heads one after another, so that with the
    # rows longest first (features/longest_first.py) the last programs to start are short ones.
    request, kv_head = tl.program_id(0) // KV_HEADS, tl.program_id(0) % KV_HEADS
    if FP8:  # features/fp8/cache.py: K = K8 * k_scale, V = V8 * v_scale, folded in below
        k_scale, v_scale = tl.load(kv_scales_ptr), tl.load(kv_scales_ptr + 1)
    else:
        k_scale, v_scale = 1.0, 1.0
    seqlen = tl.load(cache_seqlens_ptr + request)
    # The query heads of this KV head, padded to 16 rows for tl.dot: [GROUP_PADDED, HEAD_DIM].
    group_rows = tl.arange(0, GROUP_PADDED)
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = request * q_stride_request + heads[:, None] * q_stride_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=group_rows[:, None] < GROUP, other=0.0)
    if FP8:  # e4m3 widens to float16 exactly, a pair per instruction: the products run in fp16
        q = q.to(tl.float16)

    m = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PADDED], tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM], tl.float32)
    slots = tl.arange(0, TILE)
    in_tile = slots[:, None] * kv_stride_slot + dims[None, :]  # [TILE, HEAD_DIM], the same every tile
    for tile in range(0, tl.cdiv(seqlen, TILE)):
        tokens = tile * TILE + slots
        cached = tokens < seqlen
        if TILE <= BLOCK_SIZE:
            # The tile lies inside one block (both are powers of two): one load of the table
            # and one base address for all its rows: faster than a table entry per token, as
            # below (docs/fp8.md).
            block = tl.load(block_table_ptr + request * table_stride_request + tile * TILE // BLOCK_SIZE)
            base = (block.to(tl.int64) * kv_stride_block + kv_head * kv_stride_head
                    + (tile * TILE % BLOCK_SIZE) * kv_stride_slot)
            k_rows, v_rows = key_blocks_ptr + base + in_tile, value_blocks_ptr + base + in_tile
        else:
            # Logical block token // BLOCK_SIZE of this request lives in physical block `blocks`.
            blocks = tl.load(block_table_ptr + request * table_stride_request + tokens // BLOCK_SIZE,
                             mask=cached, other=0)
            kv_offsets = (blocks.to(tl.int64) * kv_stride_block + (tokens % BLOCK_SIZE) * kv_stride_slot
                          + kv_head * kv_stride_head)[:, None] + dims[None, :]  # [TILE, HEAD_DIM]
            k_rows, v_rows = key_blocks_ptr + kv_offsets, value_blocks_ptr + kv_offsets
        k = tl.load(k_rows, mask=cached[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * (scale * k_scale)  # [GROUP_PADDED, TILE], float32
        scores = tl.where(cached[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        rescale = tl.exp(m - m_new)  # how much the old sums shrink under the new maximum
        l = l * rescale + tl.sum(p, 1)
        v = tl.load(v_rows, mask=cached[:, None], other=0.0).to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]  # nothing cached: zeros
    out_offsets = request * out_stride_request + heads[:, None] * out_stride_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=group_rows[:, None] < GROUP)


def paged_decode(q, key_blocks, value_blocks, block_table, cache_seqlens, kv_scales=None,
                 tile: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """q: [B, n_heads, d]; key_blocks, value_blocks: [num_blocks, block_size, n_kv_heads, d];
    block_table: [B, max_blocks] int32; cache_seqlens: [B] int32. Returns [B, n_heads, d].
    kv_scales: [2] float32 on the device, K's and V's scale, for float8 blocks
    (features/fp8/cache.py). tile, num_warps: by default this dtype's (tools/decode_kernel_cost.py
    times others)."""
    fp8 = kv_scales is not None
    tile = tile or (FP8_TOKENS_PER_TILE if fp8 else TOKENS_PER_TILE)
    num_warps = num_warps or (FP8_NUM_WARPS if fp8 else NUM_WARPS)
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = key_blocks.shape
    group = n_heads // n_kv_heads
    out = torch.empty(batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    paged_decode_kernel[(batch * n_kv_heads,)](
        q, key_blocks, value_blocks, block_table, cache_seqlens, out,
        q if kv_scales is None else kv_scales, head_dim ** -0.5,
        q.stride(0), q.stride(1), key_blocks.stride(0), key_blocks.stride(1), key_blocks.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, KV_HEADS=n_kv_heads, GROUP=group,
        GROUP_PADDED=max(16, triton.next_power_of_2(group)), TILE=tile, FP8=fp8, num_warps=num_warps)
    return out


class TritonAttention:
    """Decode through `paged_decode`; prefill through PyTorch's SDPA on the packed prompts."""

    name = "triton"
    prefill_in_graphs = False  # its SDPA's nested tensor is built from the bounds on the host
    paged_decode = staticmethod(paged_decode)  # the kernel itself, for the FP8 caches' float8 blocks

    def __init__(self):
        self._split_of = self._split = None  # the last prefill batch, and _fresh_part's answer

    def prefill(self, q, k, v, batch):
        """One SDPA call for the whole chunk: the prompts as a nested (jagged) tensor, which
        PyTorch's fused kernels take on CUDA. They want as many K/V heads as query heads."""
        group = q.shape[1] // k.shape[1]
        offsets, bounds = batch.cu_seqlens.long(), batch.cu_seqlens_host
        shortest = min(end - start for start, end in zip(bounds[:-1], bounds[1:]))
        as_nested = lambda t: torch.nested.nested_tensor_from_jagged(  # [B, heads, length, d]
            t.contiguous(), offsets, min_seqlen=shortest, max_seqlen=batch.max_seqlen  # no sync
        ).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            as_nested(q), as_nested(k.repeat_interleave(group, 1)),
            as_nested(v.repeat_interleave(group, 1)), is_causal=True)
        return out.transpose(1, 2).values()  # [T, n_heads, d]

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch):
        """A chunk comes here as soon as one of its prompts has cached tokens, yet most have
        none (W2 with blocks of 16: 56 of 2,000 prompts begin with a block another one cached).
        Those go through `prefill`'s fused kernel, their K/V read back from the slots just
        written. The others take the reference's loop: the fused kernels' causal mask is aligned
        to the first key, right only where a prompt has nothing cached before its own tokens."""
        fresh = self._fresh_part(batch)
        cached_prompts = range(len(batch.cu_seqlens_host) - 1) if fresh is None else fresh[2]
        out = torch.empty_like(q)  # the cached prompts' rows here, the fresh ones' below
        for r in cached_prompts:
            out[slice(*batch.cu_seqlens_host[r:r + 2])] = attend_after_prefix(
                r, q, key_blocks, value_blocks, batch)
        if fresh is None:
            return out
        tokens, fresh_batch, _ = fresh
        k, v = (blocks.flatten(0, 1)[fresh_batch.slot_mapping] for blocks in (key_blocks, value_blocks))
        out[tokens] = self.prefill(q[tokens], k, v, fresh_batch)
        return out

    def _fresh_part(self, batch):
        """The chunk's prompts with nothing cached: their tokens' indices ([T'] on the GPU), a
        batch of them alone, and the other prompts' indices; None if none is fresh. Worked out
        at the first layer and kept for the others (each layer asks with the same batch)."""
        if self._split_of is not batch:
            new_tokens = np.diff(batch.cu_seqlens_host)
            fresh = new_tokens == np.diff(batch.cu_seqlens_k_host)
            self._split_of, self._split = batch, None
            if fresh.any():
                device = batch.slot_mapping.device
                tokens = to_device(np.flatnonzero(np.repeat(fresh, new_tokens)), device)
                bounds = np.concatenate([[0], np.cumsum(new_tokens[fresh])])
                fresh_batch = AttentionMetadata(
                    Phase.PREFILL, batch.slot_mapping[tokens],
                    cu_seqlens=to_device(bounds, device, torch.int32),
                    cu_seqlens_host=bounds.tolist(), max_seqlen=int(new_tokens[fresh].max()))
                self._split = tokens, fresh_batch, np.flatnonzero(~fresh).tolist()
        return self._split

    def decode(self, q, key_blocks, value_blocks, batch):
        return paged_decode(q, key_blocks, value_blocks, batch.block_table, batch.cache_seqlens)


class TritonDecode(FlashAttentionAfterPrefix):
    """flash-attn for prefill, `paged_decode` for decode steps (--decode-kernel triton): at W's
    few hundred tokens per request it reads the cache faster than flash-attn's decode kernel
    (tools/decode_kernel_cost.py, docs/speed.md)."""

    paged_decode = staticmethod(paged_decode)  # the kernel itself, for the FP8 caches' float8 blocks

    def decode(self, q, key_blocks, value_blocks, batch):
        return paged_decode(q, key_blocks, value_blocks, batch.block_table, batch.cache_seqlens)
