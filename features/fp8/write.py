"""The FP8 cache's write in one kernel: a step's new K and V rows, quantized and stored.

features/fp8/cache.py's `write_float8` says it in PyTorch: for K and for V, widen to float32,
divide by the layer's scale, clamp to float8's range, cast, and copy into the token's slot. That is
ten kernels a layer, each a few microseconds for a decode step's few hundred rows, where the
16-bit cache launches two. Here one program takes one token: it reads the token's K row and V
row, quantizes them in registers and stores them in its slot (W2 with the FP8 cache ran 1.06x
faster for it on the H200, docs/fp8.md). It does the same float32 arithmetic in the same order
(an IEEE division, round-to-nearest-even into e4m3), so the bytes are those of the PyTorch
write: tests/test_gpu.py holds them equal.
"""

import triton
import triton.language as tl


@triton.jit
def write_float8_kernel(k_ptr, v_ptr, slot_mapping_ptr, key_slots_ptr, value_slots_ptr,
                        scales_ptr, k_stride, v_stride, key_slots_stride, value_slots_stride,
                        ROW: tl.constexpr, ROW_PADDED: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    columns = tl.arange(0, ROW_PADDED)  # a token's n_kv_heads * head_dim values, padded to 2^k
    in_row = columns < ROW
    k_scale, v_scale = tl.load(scales_ptr), tl.load(scales_ptr + 1)
    k = tl.load(k_ptr + token * k_stride + columns, mask=in_row).to(tl.float32)
    v = tl.load(v_ptr + token * v_stride + columns, mask=in_row).to(tl.float32)
    k8 = tl.clamp(tl.div_rn(k, k_scale), -FP8_MAX, FP8_MAX).to(key_slots_ptr.dtype.element_ty)
    v8 = tl.clamp(tl.div_rn(v, v_scale), -FP8_MAX, FP8_MAX).to(value_slots_ptr.dtype.element_ty)
    tl.store(key_slots_ptr + slot * key_slots_stride + columns, k8, mask=in_row)
    tl.store(value_slots_ptr + slot * value_slots_stride + columns, v8, mask=in_row)


def write_float8_rows(k, v, slot_mapping, key_slots, value_slots, scales, fp8_max: float) -> None:
    """k, v: [T, n_kv_heads, head_dim] in the model's dtype; slot_mapping: [T] int64;
    key_slots, value_slots: [slots, n_kv_heads, head_dim] float8; scales: [2] float32, K's, V's."""
    for rows in (k, v, key_slots, value_slots):  # each token's row is one contiguous run
        assert rows.stride(2) == 1 and rows.stride(1) == rows.shape[2], rows.stride()
    row = k.shape[1] * k.shape[2]
    write_float8_kernel[(k.shape[0],)](
        k, v, slot_mapping, key_slots, value_slots, scales, k.stride(0), v.stride(0),
        key_slots.stride(0), value_slots.stride(0),
        ROW=row, ROW_PADDED=triton.next_power_of_2(row), FP8_MAX=fp8_max)
