"""Prefill after cached tokens: a prompt whose first tokens are in the pool already computes only
the rest.

The lesson (llama3_paged.py) prefills every prompt of its static batch from the first token.
Features make prompts that begin cached: a fork shares its parent's blocks and a prompt finds its
system prompt's blocks (features/sharing.py), a swapped request comes back with its K/V
(engine/swap.py), a mixed step computes a prompt in chunks (engine/scheduler.py). Such a
prompt packs only its new tokens (engine/model_runner.py's `prefill_from`), and its attention
reads every token, cached and new, from the pool through the block table: flash-attn's varlen
kernel takes the block table too, and the reference gathers the prompt's blocks as decode does.
This file is that attention, the cache that calls it, and the decode step that samples.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llama3_paged import Decoder, FlashAttention, KVCache, PrefillBatch, TorchAttention


@dataclass
class CachedPrefillBatch(PrefillBatch):
    block_table: torch.Tensor = None  # [B, max_blocks] int32: each prompt's blocks
    cu_seqlens_k: torch.Tensor = None  # [B + 1] int32: prompt r's tokens, cached and new
    cu_seqlens_k_host: list[int] = None
    max_seqlen_k: int = 0


class KVCacheAfterPrefix(KVCache):
    def attend_with(self, backend) -> None:
        """Attention through `backend` from now on: the seam where features/cascade.py puts its
        two-part attention around the backend chosen at start-up, once a system prompt's blocks
        are known."""
        self.attention_backend = backend

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        if not isinstance(batch, CachedPrefillBatch):
            return super().attention(layer, q, k, v, batch)
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)
        return self.attention_backend.prefill_after_prefix(q, *self.blocks(layer), batch)


class FlashAttentionAfterPrefix(FlashAttention):
    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: CachedPrefillBatch):
        # The causal mask is aligned to each prompt's end: new tokens see all before them.
        return self.varlen(q, key_blocks, value_blocks, batch.cu_seqlens, batch.cu_seqlens_k,
                           batch.max_seqlen, batch.max_seqlen_k, causal=True,
                           block_table=batch.block_table)


class TorchAttentionAfterPrefix(TorchAttention):
    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: CachedPrefillBatch):
        out = torch.empty_like(q)
        for r in range(len(batch.cu_seqlens_host) - 1):
            out[slice(*batch.cu_seqlens_host[r:r + 2])] = attend_after_prefix(
                r, q, key_blocks, value_blocks, batch)
        return out


def attend_after_prefix(r: int, q, key_blocks, value_blocks, batch) -> torch.Tensor:
    """Prompt r's new tokens, its every key and value read from its blocks (the reference)."""
    start, end = batch.cu_seqlens_host[r:r + 2]
    n_k = batch.cu_seqlens_k_host[r + 1] - batch.cu_seqlens_k_host[r]
    table = batch.block_table[r, :math.ceil(n_k / key_blocks.shape[1])]
    k, v = (blocks[table].flatten(0, 1)[:n_k] for blocks in (key_blocks, value_blocks))
    return attend(q[start:end], k, v)


def attend(q, k, v) -> torch.Tensor:
    """A prompt's n_q newest tokens over all its n_k: query i, at position n_k - n_q + i, sees the
    keys up to it. q: [n_q, n_heads, d]; k, v: [n_k, n_kv_heads, d]."""
    n_q, n_k = len(q), len(k)
    positions = torch.arange(n_k, device=q.device)
    sees = positions <= positions[n_k - n_q:, None]  # [n_q, n_k]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=sees, enable_gqa=True).transpose(0, 1)


def greedy(logits, rows, lengths) -> torch.Tensor:
    """The likeliest token, [B, vocab] -> [B]: the sampler of a run that samples nothing. A
    sampler (features/sampling.py) reads each row and its length, to seed its draw."""
    return logits.argmax(-1)


class SamplingDecoder(Decoder):
    """The lesson's decode step with the next tokens chosen by `sampler` (greedy, sampled,
    beams), inside the step, so that CUDA graphs record it too."""

    def __init__(self, model, cache, block_table, sampler=greedy):
        super().__init__(model, cache, block_table)
        self.sampler = sampler

    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor:
        logits = self.logits(tokens, positions, rows, slots, max_cache_seqlen)  # [B, vocab]
        return self.sampler(logits, rows, positions + 1)  # [B]
