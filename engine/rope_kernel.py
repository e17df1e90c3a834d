"""RoPE in one Triton kernel, as the compiled layers run it (engine/compiled_layers.py).

The lesson rotates each adjacent pair (x[2i], x[2i+1]) of a head by its position's angle, as one
complex multiplication (llama3_paged.py's apply_rope). Given the same rotation in real arithmetic,
inductor generates a kernel that loads each number of a pair apart, at every other address:
loads the GPU cannot merge into wide ones. Here one program takes one token's heads, eight at a
time: it loads them as whole rows, splits each row into its even and odd numbers in registers,
rotates the pairs in float32 and joins them back, some ten times as fast (docs/speed.md). The arithmetic is apply_rope's, in its order; tests/test_gpu.py holds the bytes
equal.
"""

import torch
import triton
import triton.language as tl

HEADS_PER_PROGRAM = 8


@triton.jit
def rope_kernel(x_ptr, rotations_ptr, out_ptr, x_token_stride, n_heads,
                HEAD_DIM: tl.constexpr, HEADS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    columns = tl.arange(0, HEAD_DIM)
    inside = heads[:, None] < n_heads
    x = tl.load(x_ptr + token * x_token_stride + heads[:, None] * HEAD_DIM + columns[None, :],
                mask=inside, other=0.0).to(tl.float32)  # [HEADS, HEAD_DIM]
    a, b = tl.split(tl.reshape(x, (HEADS, HEAD_DIM // 2, 2)))  # each [HEADS, HEAD_DIM / 2]
    # The token's angles: HEAD_DIM / 2 complex numbers, stored as (cos, sin) float32 pairs
    cos, sin = tl.split(tl.reshape(tl.load(rotations_ptr + token * HEAD_DIM + columns),
                                   (HEAD_DIM // 2, 2)))
    rotated = tl.join(a * cos[None, :] - b * sin[None, :], a * sin[None, :] + b * cos[None, :])
    out = tl.reshape(rotated, (HEADS, HEAD_DIM)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (token * n_heads + heads[:, None]) * HEAD_DIM + columns[None, :], out,
             mask=inside)


def rotate_pairs(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """apply_rope's result: x [T, heads, head_dim], each head's values one contiguous run;
    rotations [T, head_dim / 2] complex64 -> [T, heads, head_dim] in x's dtype."""
    tokens, n_heads, head_dim = x.shape
    assert head_dim & (head_dim - 1) == 0, f"a head of {head_dim} values: the kernel takes 2^k"
    assert x.stride(2) == 1 and x.stride(1) == head_dim, x.stride()
    out = torch.empty(tokens, n_heads, head_dim, dtype=x.dtype, device=x.device)
    grid = (tokens, triton.cdiv(n_heads, HEADS_PER_PROGRAM))
    rope_kernel[grid](x, torch.view_as_real(rotations.contiguous()), out, x.stride(0), n_heads,
                      HEAD_DIM=head_dim, HEADS=HEADS_PER_PROGRAM)
    return out
