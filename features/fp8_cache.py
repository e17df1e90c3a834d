"""An FP8 KV cache (--kv-cache-dtype fp8): each token's K and V in 8 bits, half the bf16 bytes.

The lesson fits more requests by wasting fewer slots; this is the other lever, fewer bytes per
slot. A pool of the same memory holds twice the tokens, and every decode step reads half the bytes
(vLLM's --kv-cache-dtype fp8; none of the small engines has it).

- Format: float8 e4m3 (4 exponent bits, 3 mantissa bits; largest value 448). Being floating
  point, it keeps about 2 significant bits of every value whatever its size, so a scale needs
  no precision, only range.
- Scales: one for K and one for V per layer, set from the layer's first prefill (its largest
  |K| and |V| times HEADROOM, over 448), as vLLM's --calculate-kv-scales does. One number per
  tensor is all the kernel needs (it multiplies the scores and the output once); finer scales
  would buy range, which a float format has plenty of, and a later token past the headroom is
  clamped to +-448 rather than overflowing.
- Writes quantize; prefill attends over the fresh bf16 K and V, as the lesson's does; decode reads
  float8. flash-attn 2 cannot read float8, so on CUDA the decode goes through the Triton kernel
  (features/triton_attention.py), which converts each tile to bf16 in registers and folds the
  scales into the scores and the output; the PyTorch reference dequantizes the blocks it gathers.
"""

import torch
import torch.distributed as dist

from features.cached_prefix import CachedPrefillBatch
from features.cuda_graphs import KVCacheWithSpareSlot
from llama3_paged import PrefillBatch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
HEADROOM = 2.0  # scales leave room for later tokens twice the first prefill's largest


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


class FP8KVCache(KVCacheWithSpareSlot):
    """The pool in float8, with a spare slot for CUDA graphs' padding rows (used or not)."""

    def __init__(self, args, num_blocks: int, block_size: int, dtype, device, attention):
        super().__init__(args, num_blocks, block_size, FP8, device, attention)
        self.model_dtype = dtype
        # [n_layers, 2]: K's and V's scale; 1 until the layer's first prefill sets them
        self.scales = torch.ones(args.n_layers, 2, dtype=torch.float32, device=device)
        self.scaled = [False] * args.n_layers  # on the host: no sync to ask

    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor:
        if isinstance(batch, PrefillBatch) and not self.scaled[layer]:
            amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()  # [2], no host sync
            if dist.is_initialized():  # split heads (features/tensor_parallel.py): the largest
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # over all, as one process's scale
            self.scales[layer] = (amax * HEADROOM / FP8_MAX).clamp(min=1e-8)
            self.scaled[layer] = True
        k_scale, v_scale = self.scales[layer, 0], self.scales[layer, 1]
        # float8 has no index_copy_ kernel: the same bytes, written as uint8
        self.k[layer].view(torch.uint8).index_copy_(0, batch.slot_mapping,
                                                    quantize(k, k_scale).view(torch.uint8))
        self.v[layer].view(torch.uint8).index_copy_(0, batch.slot_mapping,
                                                    quantize(v, v_scale).view(torch.uint8))
        if isinstance(batch, CachedPrefillBatch):  # features/run.py refuses the runs that make them
            raise RuntimeError("the FP8 cache cannot attend after a cached prefix yet")
        if isinstance(batch, PrefillBatch):  # the fresh bf16 K/V: nothing cached before them
            return self.attention_backend.prefill(q, k, v, batch)
        key_blocks, value_blocks = self.blocks(layer)
        if self.attention_backend.name == "torch":
            return self.attention_backend.decode(
                q, DequantizedBlocks(key_blocks, k_scale, q.dtype),
                DequantizedBlocks(value_blocks, v_scale, q.dtype), batch)
        from features.triton_attention import paged_decode
        return paged_decode(q, key_blocks, value_blocks, batch.block_table, batch.cache_seqlens,
                            kv_scales=self.scales[layer])
