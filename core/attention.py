"""Attention over a block-table KV cache, two ways: the PyTorch reference and flash-attn.
(features/triton_attention.py adds a Triton kernel, for GPUs without flash-attn.)

Both read the same pool, `[num_blocks, block_size, n_kv_heads, head_dim]` per layer, through the
same `block_table` (`[batch, max_blocks]`: row r lists the physical blocks of request r, in order)
and `cache_seqlens` (`[batch]`: how many of those slots hold tokens).
"""

import math

import torch
import torch.nn.functional as F

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2's paged kernel reads the cache in 256-token pages


class TorchAttention:
    """Readable and slow: gathers every request's blocks into a dense tensor, then runs SDPA.
    It runs anywhere (CPU included) and is the oracle the tests hold flash-attn to."""

    name = "torch"
    cuda_graphs = False  # its gather is sized by the longest request, a number on the host

    def prefill(self, q, k, v, batch):
        """Causal attention within each packed prompt. q: [T, n_heads, d]; k, v: [T, n_kv_heads, d].
        Prompts start with an empty cache, so the fresh k and v are all there is to attend to."""
        out = torch.empty_like(q)
        bounds = batch.cu_seqlens_host
        for start, end in zip(bounds[:-1], bounds[1:]):
            q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, len, d]
            out[start:end] = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=True, enable_gqa=True).transpose(0, 1)
        return out

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch, prompts=None):
        """Prompts whose first tokens were cached already (prefix caching): q holds the rest of
        each, and every token, cached or new, is read from the pool. Query i of a prompt with
        n_k tokens of which n_q are in q sits at position n_k - n_q + i and sees keys up to it.
        `prompts`: the indices of those to compute (default all; the others' rows stay unset)."""
        out = torch.empty_like(q)
        q_bounds, k_bounds = batch.cu_seqlens_host, batch.cu_seqlens_k_host
        block_size = key_blocks.shape[1]
        for r in range(len(q_bounds) - 1) if prompts is None else prompts:
            start, end = q_bounds[r], q_bounds[r + 1]
            n_q, n_k = end - start, k_bounds[r + 1] - k_bounds[r]
            table = batch.block_table[r, :math.ceil(n_k / block_size)]
            k = key_blocks[table].flatten(0, 1)[:n_k].transpose(0, 1)  # [n_kv_heads, n_k, d]
            v = value_blocks[table].flatten(0, 1)[:n_k].transpose(0, 1)
            sees = (torch.arange(n_k, device=q.device)[None, :]
                    <= torch.arange(n_k - n_q, n_k, device=q.device)[:, None])  # [n_q, n_k]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k, v, attn_mask=sees, enable_gqa=True).transpose(0, 1)
        return out

    def decode(self, q, key_blocks, value_blocks, batch):
        """One new token per request. q: [B, n_heads, d] -> [B, n_heads, d]."""
        block_size = key_blocks.shape[1]
        max_len = batch.max_cache_seqlen  # known on the host: gather only blocks someone uses
        table = batch.block_table[:, :math.ceil(max_len / block_size)]
        k = key_blocks[table].flatten(1, 2)[:, :max_len]  # [B, max_len, n_kv_heads, d]
        v = value_blocks[table].flatten(1, 2)[:, :max_len]
        holds_token = torch.arange(max_len, device=q.device) < batch.cache_seqlens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=holds_token[:, None, None, :], enable_gqa=True)  # [B, n_heads, 1, d]
        return out[:, :, 0]


class FlashAttention:
    """flash-attn 2: varlen prefill over the packed prompts; paged decode that follows
    block_table inside the kernel, reading each block once, never gathering."""

    name = "flash"
    cuda_graphs = True  # reads block_table and cache_seqlens on the GPU: no host numbers

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prefill(self, q, k, v, batch):
        return self.varlen(q, k, v, batch.cu_seqlens, batch.cu_seqlens,
                           batch.max_seqlen, batch.max_seqlen, causal=True)

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch):
        """The varlen kernel reads the cached prefix through the block table; its causal mask is
        aligned to the end of each prompt, so the new tokens see everything before them."""
        return self.varlen(q, key_blocks, value_blocks, batch.cu_seqlens, batch.cu_seqlens_k,
                           batch.max_seqlen, batch.max_seqlen_k, causal=True,
                           block_table=batch.block_table)

    def decode(self, q, key_blocks, value_blocks, batch):
        out = self.with_kvcache(q[:, None], key_blocks, value_blocks,  # q: [B, 1, n_heads, d]
                                cache_seqlens=batch.cache_seqlens, block_table=batch.block_table,
                                causal=True)
        return out[:, 0]
