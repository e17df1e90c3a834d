"""A step's new K and V rows stored in their slots in one kernel; quantized there for FP8 K/V.

The lesson stores K and then V with `index_copy_`: two kernels a layer. The FP8 cache's write in
PyTorch (features/fp8/cache.py's `write_float8`) widens, divides, clamps, casts and copies each:
ten kernels, each a few microseconds at a decode step's few hundred rows. Here one program takes
one token: it reads the token's K row and V row, quantizes them in registers when the pool is
float8, and stores them in the token's slot, as nano-vllm's `store_kvcache` does for 16-bit K/V.
The bytes are those of the PyTorch writes (in float8 the same float32 arithmetic in the same
order: an IEEE division, round-to-nearest-even into e4m3): tests/test_gpu.py holds them equal.
"""

import triton
import triton.language as tl


@triton.jit
def write_rows_kernel(k_ptr, v_ptr, slot_mapping_ptr, key_slots_ptr, value_slots_ptr, scales_ptr,
                      k_stride, v_stride, key_slots_stride, value_slots_stride,
                      ROW: tl.constexpr, ROW_PADDED: tl.constexpr, QUANTIZE: tl.constexpr,
                      FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    columns = tl.arange(0, ROW_PADDED)  # a token's n_kv_heads * head_dim values, padded to 2^k
    in_row = columns < ROW
    k = tl.load(k_ptr + token * k_stride + columns, mask=in_row)
    v = tl.load(v_ptr + token * v_stride + columns, mask=in_row)
    if QUANTIZE:  # float8, with the layer's scales for K and for V
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(scales_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(scales_ptr + 1)), -FP8_MAX, FP8_MAX)
    tl.store(key_slots_ptr + slot * key_slots_stride + columns,
             k.to(key_slots_ptr.dtype.element_ty), mask=in_row)
    tl.store(value_slots_ptr + slot * value_slots_stride + columns,
             v.to(value_slots_ptr.dtype.element_ty), mask=in_row)


def write_rows(k, v, slot_mapping, key_slots, value_slots, scales=None, fp8_max: float = 0.0):
    """k, v: [T, n_kv_heads, head_dim] in the model's dtype, into rows slot_mapping ([T] int64) of
    key_slots and value_slots ([slots, n_kv_heads, head_dim]): in the model's dtype, or in float8
    with scales ([2] float32: K's, V's) and fp8_max, float8's largest value."""
    for rows in (k, v, key_slots, value_slots):  # each token's row is one contiguous run
        assert rows.stride(2) == 1 and rows.stride(1) == rows.shape[2], rows.stride()
    row = k.shape[1] * k.shape[2]
    # Without scales the kernel never reads scales_ptr; k stands in, as any pointer would
    write_rows_kernel[(k.shape[0],)](
        k, v, slot_mapping, key_slots, value_slots, k if scales is None else scales,
        k.stride(0), v.stride(0), key_slots.stride(0), value_slots.stride(0),
        ROW=row, ROW_PADDED=triton.next_power_of_2(row), QUANTIZE=scales is not None,
        FP8_MAX=fp8_max)
