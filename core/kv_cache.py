"""The KV cache of the naive and paged scripts: a pool of fixed-size blocks, addressed by slot.

A slot is one token's K and V in one layer; slot `s` lives in block `s // block_size` at offset
`s % block_size`. The naive script makes one block per request, `max_seq_len` slots long; the
paged script makes many small blocks and hands them out as requests grow. The code is the same:
only `num_blocks` and `block_size` differ, and who writes the block table.

One spare slot sits past the last block, in no block: K and V that a step must write and no one
will read go there (the padding rows of a fixed-size batch, features/cuda_graphs.py).
"""

from dataclasses import dataclass

import numpy as np
import torch


def to_device(array: np.ndarray, device, dtype=None) -> torch.Tensor:
    """A host array on the device, without making the host wait. A copy from ordinary (pageable)
    host memory waits until the GPU has finished everything queued before it, so one made while
    the GPU runs a step would hold the host until the step ends; a copy from pinned
    (page-locked) memory is queued like a kernel. (PyTorch keeps the pinned buffer alive until
    its copy is done.)"""
    tensor = torch.from_numpy(array)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, dtype, non_blocking=True)


@dataclass
class PrefillBatch:
    """Prompts packed into one sequence of T tokens. A prompt may begin with tokens cached already
    (a shared prefix, or a part prefilled before): then only the rest is packed here, and
    attention reads all of them, cached and new, from the pool through the block table."""

    slot_mapping: torch.Tensor  # [T] int64: the slot each token's K/V is written to
    cu_seqlens: torch.Tensor  # [B + 1] int32: prompt r is tokens cu_seqlens[r]:cu_seqlens[r+1]
    cu_seqlens_host: list[int]
    max_seqlen: int
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, when a prefix is cached
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32: prompt r's tokens, cached and new
    cu_seqlens_k_host: list[int] | None = None
    max_seqlen_k: int = 0


@dataclass
class DecodeBatch:
    """One new token for each of B requests."""

    slot_mapping: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int32: the physical blocks of each request
    cache_seqlens: torch.Tensor  # [B] int32: tokens cached per request, the new one included
    max_cache_seqlen: int


class KVCache:
    def __init__(self, args, num_blocks: int, block_size: int, dtype, device, attention):
        self.num_blocks, self.block_size, self.attention_backend = num_blocks, block_size, attention
        self.block_shape = (num_blocks, block_size, args.n_kv_heads, args.head_dim)
        # [n_layers, num_blocks * block_size + 1, n_kv_heads, head_dim]: allocated once, up front.
        # Zeroed, so that slots no token has written stay finite.
        self.spare_slot = num_blocks * block_size
        slots_shape = (args.n_layers, self.spare_slot + 1, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(slots_shape, dtype=dtype, device=device)
        self.v = torch.zeros(slots_shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        """Store this batch's k, v (`[T, n_kv_heads, head_dim]`) in their slots, then attend."""
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)
        if isinstance(batch, PrefillBatch) and batch.block_table is None:
            return self.attention_backend.prefill(q, k, v, batch)  # nothing cached: k, v are all
        key_blocks = self.k[layer, :self.spare_slot].view(self.block_shape)  # same memory, as blocks
        value_blocks = self.v[layer, :self.spare_slot].view(self.block_shape)
        if isinstance(batch, PrefillBatch):
            return self.attention_backend.prefill_after_prefix(q, key_blocks, value_blocks, batch)
        return self.attention_backend.decode(q, key_blocks, value_blocks, batch)
