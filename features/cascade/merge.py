"""cascade.py's merge in one pass, in Triton: what the GPU runs after flash-attn's two parts.

Written with PyTorch (cascade.merge) the merge is half a dozen elementwise kernels per layer,
each reading and writing the step's [B, n_heads, d] outputs in float32. At the start of a stream,
with a couple of thousand requests running, that is more time per step than the shared part
saves. Here one program per request reads both parts' outputs and log-sum-exps once and writes
the merged output once, in the same arithmetic: own + w (shared - own), w = sigmoid(lse_shared -
lse_own), in float32.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def merge_kernel(out_ptr, shared_ptr, own_ptr, lse_shared_ptr, lse_own_ptr,
                 lse_shared_stride_request, lse_shared_stride_head,
                 lse_own_stride_request, lse_own_stride_head,
                 N_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr):
    request = tl.program_id(0)
    heads = tl.arange(0, HEADS_PADDED)  # tl.arange needs a power of two: mask the rest
    is_head = heads < N_HEADS
    lse_shared = tl.load(lse_shared_ptr + request * lse_shared_stride_request
                         + heads * lse_shared_stride_head, mask=is_head, other=0.0)
    lse_own = tl.load(lse_own_ptr + request * lse_own_stride_request
                      + heads * lse_own_stride_head, mask=is_head, other=0.0)
    # sigmoid(lse_shared - lse_own): an exp that overflows gives w = 0, as it should.
    w = (1.0 / (1.0 + tl.exp(lse_own - lse_shared)))[:, None]  # [HEADS_PADDED, 1]
    offsets = (request * N_HEADS + heads[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    own = tl.load(own_ptr + offsets, mask=is_head[:, None], other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + offsets, mask=is_head[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (own + w * (shared - own)).to(out_ptr.dtype.element_ty),
             mask=is_head[:, None])


def fused_merge(out_shared, lse_shared, out_own, lse_own) -> torch.Tensor:
    """cascade.merge's result. out_*: [B, n_heads, d], contiguous; lse_*: [B, n_heads], fp32."""
    batch, n_heads, head_dim = out_own.shape
    out_shared, out_own = out_shared.contiguous(), out_own.contiguous()
    out = torch.empty_like(out_own)
    merge_kernel[(batch,)](out, out_shared, out_own, lse_shared, lse_own,
                           *lse_shared.stride(), *lse_own.stride(), N_HEADS=n_heads,
                           HEADS_PADDED=triton.next_power_of_2(n_heads), HEAD_DIM=head_dim)
    return out
