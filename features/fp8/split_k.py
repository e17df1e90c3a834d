"""o's and down's float8 matmul at a decode step's rows, its sum over K split (--quantization fp8).

torch._scaled_mm (cuBLAS's row-wise float8 kernel) gives each tile of the output to one program.
o and down write the residual stream, 4,096 columns for 8B: at a decode step of up to 128 rows
that is at most 64 tiles for an H200's 132 SMs, and most SMs wait while a few walk all of K.
Here K is cut in four slices and each (tile, slice) is a program of its own, which writes its
float32 partial sums. The caller adds the slices and applies both scales, which compiled layers
fold into the residual add that follows. From 200 rows on cuBLAS is as fast or faster, so it
takes those (docs/fp8.md measures both).

More in docs/engine-notes.md.
"""

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 128  # rows, output columns and K per program and step
K_SLICES = 4  # the fastest for down at 64 and 128 rows of 1, 2, 4, 7 or 8 (docs/fp8.md)


def slices(rows: int) -> int:
    """How many slices of K at `rows` rows; 0: cuBLAS's kernel (above)."""
    return K_SLICES if rows <= 128 else 0


def fits(n_in: int, n_out: int) -> bool:
    """Whether a projection's shape divides into this kernel's tiles and slices."""
    return n_in % (K_SLICES * BLOCK_K) == 0 and n_out % BLOCK_N == 0


@triton.jit
def partial_sums_kernel(x_ptr, w_ptr, out_ptr, rows, n_out, n_in, k_per_slice,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, k_slice = tl.program_id(0), tl.program_id(1)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    # Neighbouring programs share a tile of columns: its weights are read from memory once
    first_row, first_col = (tile % row_tiles) * BLOCK_M, (tile // row_tiles) * BLOCK_N
    # Rows past the end read row r % rows (a real one, no mask in the loop), and are not stored
    r = (first_row + tl.arange(0, BLOCK_M)) % rows
    c = first_col + tl.arange(0, BLOCK_N)
    k = k_slice * k_per_slice + tl.arange(0, BLOCK_K)
    x = x_ptr + r[:, None].to(tl.int64) * n_in + k[None, :]  # [BLOCK_M, BLOCK_K] float8
    w = w_ptr + c[:, None].to(tl.int64) * n_in + k[None, :]  # [BLOCK_N, BLOCK_K] float8
    sums = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_per_slice // BLOCK_K):
        sums += tl.dot(tl.load(x), tl.trans(tl.load(w)))  # one BLOCK_K's sums, added in float32
        x += BLOCK_K
        w += BLOCK_K
    out_rows = first_row + tl.arange(0, BLOCK_M)
    out = out_ptr + (k_slice * rows + out_rows[:, None]).to(tl.int64) * n_out + c[None, :]
    tl.store(out, sums, mask=out_rows[:, None] < rows)


# An opaque custom op, not a triton_op as swiglu_quantize.py's: compiled layers call it as it is
# and fold the sum after it into the residual add. Traced into inductor's code (triton_op), this
# kernel was slower than the cuBLAS kernels it replaced (docs/fp8.md).
@torch.library.custom_op("fp8_weights::partial_sums", mutates_args=())
def partial_sums(x8: torch.Tensor, w8: torch.Tensor, k_slices: int) -> torch.Tensor:
    """x8: [T, in] float8, w8: [out, in] float8 -> [k_slices, T, out] float32, x8 @ w8^T over
    each of k_slices equal slices of the in features, unscaled."""
    rows, n_in = x8.shape
    n_out = w8.shape[0]
    out = torch.empty(k_slices, rows, n_out, dtype=torch.float32, device=x8.device)
    grid = (triton.cdiv(rows, BLOCK_M) * (n_out // BLOCK_N), k_slices)
    partial_sums_kernel[grid](x8.contiguous(), w8, out, rows, n_out, n_in, n_in // k_slices,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
                              num_stages=4)
    return out


@partial_sums.register_fake
def _(x8: torch.Tensor, w8: torch.Tensor, k_slices: int) -> torch.Tensor:
    """What the compiler traces: the output's shape and dtype."""
    return x8.new_empty(k_slices, x8.shape[0], w8.shape[0], dtype=torch.float32)
