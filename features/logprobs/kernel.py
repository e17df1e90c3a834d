"""A row's log-sum-exp, its chosen token's log-probability and rank, in one read of its logits.

PyTorch takes four passes over [B, vocab] for these (a float32 copy, logsumexp, a comparison
and a sum), some 5% of a decode step at W2's batches (docs/speed.md). This kernel reads the 16-bit logits once, a program per row, keeping an online
maximum and sum of exponentials (as flash attention's softmax) and a count of the logits above
the chosen one: about the time of the read.
"""

import torch
import triton
import triton.language as tl

TILE = 2048  # logits read per loop step of a row's program


@triton.jit
def row_stats_kernel(logits_ptr, tokens_ptr, out_ptr, vocab, row_stride, TILE: tl.constexpr):
    row = tl.program_id(0)
    logits = logits_ptr + row.to(tl.int64) * row_stride
    chosen = tl.load(logits + tl.load(tokens_ptr + row)).to(tl.float32)
    maximum = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)  # sum of exp(logit - maximum)
    above = tl.zeros((), tl.int32)  # logits larger than the chosen one
    for start in range(0, vocab, TILE):
        offsets = start + tl.arange(0, TILE)
        x = tl.load(logits + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32)
        new_maximum = tl.maximum(maximum, tl.max(x, axis=0))
        total = total * tl.exp(maximum - new_maximum) + tl.sum(tl.exp(x - new_maximum), axis=0)
        maximum = new_maximum
        above += tl.sum((x > chosen).to(tl.int32), axis=0)
    log_total = maximum + tl.log(total)
    tl.store(out_ptr + row * 3, log_total)
    tl.store(out_ptr + row * 3 + 1, chosen - log_total)
    tl.store(out_ptr + row * 3 + 2, (above + 1).to(tl.float32))


def row_stats(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits: [B, vocab] on CUDA (last dimension contiguous); tokens: [B]. Returns [B, 3]
    float32: each row's log-sum-exp, its token's log-probability, and that token's rank."""
    out = torch.empty(len(logits), 3, dtype=torch.float32, device=logits.device)
    if len(logits):
        row_stats_kernel[(len(logits),)](logits, tokens, out, logits.shape[-1], logits.stride(0),
                                         TILE=TILE)
    return out
