"""The engine's KV cache: the lesson's pool, and the three things the engine's steps ask more of it.

More in docs/engine-notes.md.
"""

import math

import torch
import torch.nn.functional as F

import llama3_paged as lesson
from engine.attention_metadata import AttentionMetadata, Phase


def left_out_of_compiled_layers(method):
    """`method` as compiled layers' graphs leave it out (torch.compiler.disable): a call between
    them, in kernels of its own. Only where a run can compile, a machine with CUDA: elsewhere the
    compiler's import would make every engine run slower to start (docs/engine-notes.md)."""
    return torch.compiler.disable(method) if torch.cuda.is_available() else method


class EngineKVCache(lesson.KVCache):
    def __init__(self, args, num_blocks: int, block_size: int, dtype, device, attention,
                 spare_slot: bool = False):
        """spare_slot: one slot more, for CUDA graphs' padding rows."""
        self.has_spare_slot = spare_slot
        super().__init__(args, num_blocks, block_size, dtype, device, attention)
        self.spare_slot = self.num_slots  # the slot past the last block, if allocated

    def slots_shape(self, args) -> tuple[int, ...]:
        return (args.n_layers, self.num_slots + self.has_spare_slot, args.n_kv_heads, args.head_dim)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k[layer, :self.num_slots].view(self.block_shape),
                self.v[layer, :self.num_slots].view(self.block_shape))

    def attend_with(self, backend) -> None:
        """Attention through `backend` from now on (features/cascade/attention.py's)."""
        self.attention_backend = backend

    @left_out_of_compiled_layers
    def attention(self, layer: int, q, k, v, batch: AttentionMetadata) -> torch.Tensor:
        """The lesson's, with the write in one kernel on CUDA and prompts after cached tokens."""
        self.write(layer, k, v, batch)
        match batch.phase:
            case Phase.AFTER_PREFIX:
                return self.attend_after_prefix(layer, q, k, v, batch)
            case Phase.PREFILL:  # a prompt's own k, v are all it attends to
                return self.attention_backend.prefill(q, k, v, batch)
            case Phase.DECODE:
                return self.decode_attention(layer, q, batch)

    def attend_after_prefix(self, layer: int, q, k, v, batch: AttentionMetadata) -> torch.Tensor:
        """The prompts' new tokens over their cached tokens and themselves, through the table."""
        return self.attention_backend.prefill_after_prefix(q, *self.blocks(layer), batch)

    def decode_attention(self, layer: int, q, batch) -> torch.Tensor:
        """A decode step's attention, one new token a request over its cached ones: [B, n_heads,
        head_dim]. Alone, it is what tools/bench.py times as the decode kernel."""
        return self.attention_backend.decode(q, *self.blocks(layer), batch)

    def write(self, layer: int, k, v, batch) -> None:
        """k, v ([T, n_kv_heads, head_dim]) into their slots. On CUDA one Triton kernel stores
        both (engine/cache_write.py), the same bytes as the lesson's two index_copy_ kernels;
        the PyTorch backend keeps the lesson's write."""
        if writes_in_one_kernel(k, self.attention_backend):
            from engine.cache_write import write_rows
            write_rows(k, v, batch.slot_mapping, self.k[layer], self.v[layer])
            return
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)


def writes_in_one_kernel(k: torch.Tensor, attention_backend) -> bool:
    """Whether a step's K/V go through engine/cache_write.py's kernel: on CUDA, except under the
    PyTorch backend, whose writes stay the lesson's (the reference the kernel is tested against)."""
    return k.is_cuda and attention_backend.name != "torch"


class FlashAttentionAfterPrefix(lesson.FlashAttention):
    prefill_in_graphs = True  # flash-attn's varlen prefill reads the prompts' bounds on the GPU

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: AttentionMetadata):
        # The causal mask is aligned to each prompt's end: new tokens see all before them.
        return self.varlen(q, key_blocks, value_blocks, batch.cu_seqlens, batch.cu_seqlens_k,
                           batch.max_seqlen, batch.max_seqlen_k, causal=True,
                           block_table=batch.block_table)


class TorchAttentionAfterPrefix(lesson.TorchAttention):
    prefill_in_graphs = False  # each prompt is sliced by its bounds on the host

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch: AttentionMetadata):
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
