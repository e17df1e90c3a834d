"""Down's input in one kernel (--quantization fp8 on CUDA): SwiGLU and its per-token float8 cast.

More in docs/engine-notes.md.
"""

import torch
import triton
import triton.language as tl

from features.fp8.cache import FP8, FP8_MAX


@triton.jit
def swiglu_quantize_kernel(gate_up_ptr, row_scale_ptr, column_scale_ptr, out_ptr, scale_ptr,
                           ffn_dim, SCALED: tl.constexpr, FP8_MAX: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < ffn_dim
    gate = tl.load(gate_up_ptr + row * 2 * ffn_dim + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * ffn_dim + ffn_dim + cols, mask=inside,
                 other=0.0).to(tl.float32)
    if SCALED:  # sums of float8 products: times the token's scale and each column's
        row_scale = tl.load(row_scale_ptr + row)
        gate = gate * row_scale * tl.load(column_scale_ptr + cols, mask=inside, other=0.0)
        up = up * row_scale * tl.load(column_scale_ptr + ffn_dim + cols, mask=inside, other=0.0)
    h = gate * tl.sigmoid(gate) * up  # silu(gate) * up: [BLOCK] float32
    scale = tl.maximum(tl.max(tl.abs(h), axis=0) / FP8_MAX, 1e-12)  # as quantize_rows
    h8 = tl.clamp(h / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(out_ptr + row * ffn_dim + cols, h8, mask=inside)
    tl.store(scale_ptr + row, scale)


@torch.library.triton_op("fp8_weights::swiglu_quantize", mutates_args=())
def swiglu_quantize(gate_up: torch.Tensor, row_scale: torch.Tensor | None = None,
                    column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2 * ffn_dim], gate/up's output -> (silu(gate) * up / scale in float8
    [T, ffn_dim], scale [T, 1] float32), each row's scale its largest |value| over FP8_MAX.
    With row_scale [T, 1] and column_scale [1, 2 * ffn_dim]: gate_up holds the float8
    products' sums with unit scales, and the kernel scales them first (Float8FeedForward)."""
    rows, ffn_dim = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, ffn_dim, dtype=FP8, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    scaled = row_scale is not None
    # A row whole in one program: 8B's 14,336 numbers padded to 16,384, 64 a thread in 8 warps
    # (faster than 16 warps, or rows in chunks: docs/fp8.md).
    # Unscaled, the scales' pointers are never read: `scale` stands in for them.
    torch.library.wrap_triton(swiglu_quantize_kernel)[(rows,)](
        gate_up.contiguous(), row_scale.contiguous() if scaled else scale,
        column_scale.contiguous() if scaled else scale, out, scale, ffn_dim, SCALED=scaled,
        FP8_MAX=FP8_MAX, BLOCK=triton.next_power_of_2(ffn_dim), num_warps=8)
    return out, scale
