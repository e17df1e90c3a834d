"""An FP8 KV cache (--kv-cache-dtype fp8): each token's K and V in 8 bits, half the bf16 bytes.

The lesson fits more requests by wasting fewer slots; this is the other lever, fewer bytes per
slot. A pool of the same memory holds twice the tokens, and every decode step reads half the bytes
(vLLM's --kv-cache-dtype fp8; none of the small engines has it).

More in docs/engine-notes.md.
"""

import contextlib
import dataclasses
import math

import numpy as np
import torch
import torch.distributed as dist

from block_manager import to_device
from engine.attention_metadata import AttentionMetadata
from engine.kv_cache import EngineKVCache, writes_in_one_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
HEADROOM = 2.0  # scales leave room for later tokens twice the first prefill's largest


def scales_for(amax: torch.Tensor) -> torch.Tensor:
    """A layer's K and V scales from their largest |values| ([2] float32), with HEADROOM."""
    return (amax * HEADROOM / FP8_MAX).clamp(min=1e-8)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float8, clamped: PyTorch's cast turns what is out of range into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


class DequantizedBlocks:
    """The pool's float8 blocks, read as `dtype` one gather at a time: what the PyTorch
    reference's decode (llama3_paged.TorchAttention) indexes."""

    def __init__(self, blocks: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.blocks, self.scale, self.dtype = blocks, scale, dtype

    @property
    def shape(self):
        return self.blocks.shape

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize(self.blocks[index], self.scale, self.dtype)


class Float8Writes:
    """What both FP8 caches do with a layer's new K and V: the paged pool below and the virtual
    rows (engine/fp8_virtual_cache.py). A layer's first prefill sets its scales; every write
    quantizes with them."""

    def init_scales(self, n_layers: int, device, group) -> None:
        """group: the processes that each hold some of the heads (the process-group seam's), or
        None; a layer's scale is the largest value over them all, as one process's would be."""
        self.group = group
        # [n_layers, 2]: K's and V's scale; 1 until the layer's first prefill sets them
        self.scales = torch.ones(n_layers, 2, dtype=torch.float32, device=device)
        self.scaled = [False] * n_layers  # on the host: no sync to ask

    def forget_scales(self) -> None:
        """Unset again, for the next prefill to set: after warm-up passes (a token repeated,
        not the data the scales are for). In place: CUDA graphs read this tensor."""
        self.scales.fill_(1.0)
        self.scaled = [False] * len(self.scaled)

    @contextlib.contextmanager
    def as_if_scaled(self):
        """Inside, every layer writes with the scales it has, as after a first prefill: what
        features/prefill_graphs.py's graphs record, for the passes after the first."""
        scaled_before, self.scaled = self.scaled, [True] * len(self.scaled)
        try:
            yield
        finally:
            self.scaled = scaled_before

    def write_float8(self, layer: int, k, v, batch, key_slots, value_slots) -> None:
        """k, v: [T, n_kv_heads, head_dim] in the model's dtype, into rows batch.slot_mapping of
        key_slots and value_slots ([slots, n_kv_heads, head_dim], float8)."""
        if batch.prefills and not self.scaled[layer]:
            amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()  # [2], no host sync
            if self.group is not None:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            self.scales[layer] = scales_for(amax)
            self.scaled[layer] = True
        if writes_in_one_kernel(k, self.attention_backend):  # one kernel, not ten
            from engine.cache_write import write_rows
            write_rows(k, v, batch.slot_mapping, key_slots, value_slots, self.scales[layer],
                       FP8_MAX)
            return
        # The reference: float8 has no index_copy_ kernel, so the same bytes go as uint8.
        for slots, fresh, scale in ((key_slots, k, self.scales[layer, 0]),
                                    (value_slots, v, self.scales[layer, 1])):
            slots.view(torch.uint8).index_copy_(0, batch.slot_mapping,
                                                quantize(fresh, scale).view(torch.uint8))


class FP8KVCache(Float8Writes, EngineKVCache):
    """The pool in float8, with a spare slot for CUDA graphs' padding rows (used or not)."""

    def __init__(self, args, num_blocks: int, block_size: int, dtype, device, attention,
                 group=None):
        super().__init__(args, num_blocks, block_size, FP8, device, attention,  # float8, any dtype
                         spare_slot=True)
        self.init_scales(args.n_layers, device, group)
        self._copy_of = self._copy = None  # the last prefill batch after a prefix, and its copy's

    def write(self, layer: int, k, v, batch) -> None:
        self.write_float8(layer, k, v, batch, self.k[layer], self.v[layer])

    def decode_attention(self, layer: int, q, batch) -> torch.Tensor:
        key_blocks, value_blocks = self.blocks(layer)
        if self.attention_backend.name == "torch":
            k_scale, v_scale = self.scales[layer, 0], self.scales[layer, 1]
            return self.attention_backend.decode(
                q, DequantizedBlocks(key_blocks, k_scale, q.dtype),
                DequantizedBlocks(value_blocks, v_scale, q.dtype), batch)
        return self.attention_backend.paged_decode(  # a Triton backend's (engine/loader.py)
            q, key_blocks, value_blocks, batch.block_table, batch.cache_seqlens,
            kv_scales=self.scales[layer])

    def attend_after_prefix(self, layer: int, q, k, v, batch: AttentionMetadata) -> torch.Tensor:
        """The prompts' new tokens over their cached prefixes and themselves. The blocks they read,
        dequantized into a copy in the model's dtype: prompt r's at rows r * width .. of it, in
        order, with a block table of its own. The new tokens' fresh K/V are written over their
        float8 copies there, so that only the cached prefix carries float8's rounding."""
        width, copy_batch = self._batch_over_a_copy(batch)
        read = batch.block_table[:, :width]  # [B, width]: the pool's blocks each prompt reads
        key_blocks, value_blocks = (  # [B * width, block_size, n_kv_heads, head_dim] each
            dequantize(blocks[read], scale, q.dtype).flatten(0, 1)
            for blocks, scale in zip(self.blocks(layer), self.scales[layer]))
        for blocks, fresh in ((key_blocks, k), (value_blocks, v)):
            blocks.view(-1, *fresh.shape[1:]).index_copy_(0, copy_batch.slot_mapping, fresh)
        return self.attention_backend.prefill_after_prefix(q, key_blocks, value_blocks, copy_batch)

    def _batch_over_a_copy(self, batch: AttentionMetadata):
        """`batch` with its slots and block table in the copy: prompt r's token at position p is
        slot r * width * block_size + p there. Worked out at the first layer, kept for the rest."""
        if self._copy_of is not batch:
            new, lengths = np.diff(batch.cu_seqlens_host), np.diff(batch.cu_seqlens_k_host)
            width = math.ceil(batch.max_seqlen_k / self.block_size)
            positions = np.concatenate([np.arange(n_k - n, n_k) for n, n_k in zip(new, lengths)])
            prompts = np.repeat(np.arange(len(new)), new)
            device = batch.slot_mapping.device
            table = torch.arange(len(new) * width, dtype=torch.int32, device=device)
            slots = prompts * width * self.block_size + positions  # [T], in the copy
            self._copy_of, self._copy = batch, (width, dataclasses.replace(
                batch, slot_mapping=to_device(slots, device),
                block_table=table.view(len(new), width)))
        return self._copy
