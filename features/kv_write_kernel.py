"""K and V into the pool with one kernel (CUDA), where the lesson launches two `index_copy_`.

Every layer of every step writes its new tokens' K and V into their slots. The lesson says it
in two lines, `self.k[layer].index_copy_(0, slots, k)` and the same for v: two kernels, each a
few microseconds at any decode batch, 64 a step for Llama 3 8B. nano-vllm writes both with one
small Triton kernel, and the side-by-side profile (docs/speed.md) showed what that saves: on an
H200 at W's batch of 256, 0.82 us of cache writes per decoded token against nano-vllm's 0.24.

One program copies one token: its K row and its V row (n_kv_heads * head_dim values each,
contiguous in both the fresh k, v and the pool), to the slot the block manager gave it. The
bytes written are the lesson's, in the same places (tests/test_gpu.py holds them equal).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slots_ptr, k_stride_token,
                    v_stride_token, ROW: tl.constexpr, ROW_PADDED: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # a pool of a million slots x ROW > 2^31
    columns = tl.arange(0, ROW_PADDED)
    inside = columns < ROW  # a row of 3 heads x 64 (SmolLM2) is no power of two
    k = tl.load(k_ptr + token * k_stride_token + columns, mask=inside)
    v = tl.load(v_ptr + token * v_stride_token + columns, mask=inside)
    tl.store(k_pool_ptr + slot * ROW + columns, k, mask=inside)
    tl.store(v_pool_ptr + slot * ROW + columns, v, mask=inside)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_pool[slot_mapping] = k and v_pool[slot_mapping] = v in one launch.
    k_pool, v_pool: [num_slots, n_kv_heads, head_dim], a layer's pool; k, v: [T, n_kv_heads,
    head_dim], each token's heads side by side (views of the fused QKV output are);
    slot_mapping: [T] int64."""
    row = k_pool[0].numel()
    for x in (k, v):  # a token's heads must be one contiguous row, as the kernel reads them
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "k, v: each token's row contiguous"
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    store_kv_kernel[(len(slot_mapping),)](k, v, k_pool, v_pool, slot_mapping, k.stride(0),
                                          v.stride(0), ROW=row,
                                          ROW_PADDED=triton.next_power_of_2(row))


def write_with_one_kernel(cache) -> None:
    """From now on `cache` (features/cached_prefix.py's KVCacheAfterPrefix or a subclass) writes
    each layer's K and V with store_kv instead of the lesson's two index_copy_."""
    cache.store = lambda layer, k, v, slot_mapping: store_kv(cache.k[layer], cache.v[layer], k, v,
                                                             slot_mapping)
