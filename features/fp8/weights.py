"""FP8 weights (--quantization fp8): the projections in float8, half their bf16 bytes.

The lesson's levers shrink the KV cache; on a 24 GB card the weights are the larger share
(Llama 3 8B: 16 GB in bf16). In float8 e4m3 the projections take half, the pool gets what they
free, and every decode step, which reads every weight once, reads half as many bytes; Hopper's
float8 tensor cores also multiply at twice bf16's rate.

More in docs/engine-notes.md.
"""

import torch
import torch.distributed as dist
from torch import nn

from features.fp8.cache import FP8_MAX, quantize


def quantize_rows(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] -> (x / scale in float8 [rows, n], scale [rows, 1] float32), each row's
    scale its largest |value| over FP8_MAX (a row of zeros: a tiny scale, zeros stay zeros).
    group: each of its processes holds a slice of every row; the largest is over all of them."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return quantize(x, scale), scale


SCALES_AFTER_MAX_ROWS = 256  # cuBLAS's unit-scale kernel up to here, its row-wise one above


class Float8Linear(nn.Module):
    """y = x W^T with W in float8 and a scale per output channel; x quantized per token."""

    def __init__(self, linear: nn.Linear, group=None):
        """group: the processes that each hold a slice of the input features (o's and down's
        under torchrun), whose outputs are parts of the sum they add up; None: one process holds
        them all."""
        super().__init__()
        self.group = group
        weight, scale = quantize_rows(linear.weight.detach(), group)  # [out, in], [out, 1]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale.t().contiguous(), requires_grad=False)  # [1, out]
        # _scaled_mm multiplies float8 on CUDA and writes bf16 with row-wise scales
        self.uses_scaled_mm = weight.is_cuda and linear.weight.dtype == torch.bfloat16
        self.register_buffer("one", torch.ones((), device=weight.device),  # the unit scale
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out], in x's dtype."""
        return self.multiply(*quantize_rows(x, self.group), x.dtype)

    def multiply(self, x8: torch.Tensor, x_scale: torch.Tensor, dtype) -> torch.Tensor:
        """An input quantized per token, x8: [T, in] float8 and x_scale: [T, 1], -> [T, out]."""
        if self.uses_scaled_mm and x8.shape[0] <= SCALES_AFTER_MAX_ROWS:
            # At a decode step's rows cuBLAS's kernel for one scale per matrix is 2 to 3 times
            # faster than its row-wise one (q/k/v at 8 rows: 6.4 against 18.4 us, docs/fp8.md):
            # unit scales, then the scales in one multiply, which compiled layers fuse with the
            # elementwise work around it (o's and down's residual add). From 512 rows the
            # row-wise kernel is the faster.
            out = (self.sums(x8, dtype) * x_scale * self.scale).to(dtype)
        elif self.uses_scaled_mm:
            # weight.t() is [in, out] column-major: the layout the float8 tensor cores read
            out = torch._scaled_mm(x8, self.weight.t(), scale_a=x_scale, scale_b=self.scale,
                                   out_dtype=dtype)
        else:
            out = reference_matmul(x8, x_scale, self.weight, self.scale).to(dtype)
        if self.group is not None:
            dist.all_reduce(out, group=self.group)  # this process's part of the sum: the whole
        return out

    def sums(self, x8: torch.Tensor, dtype) -> torch.Tensor:
        """x8: [T, in] float8 -> [T, out], the float8 products' sums with unit scales (cuBLAS's
        kernel for one scale per matrix), rounded to dtype: the caller applies the scales."""
        return torch._scaled_mm(x8, self.weight.t(), scale_a=self.one, scale_b=self.one,
                                out_dtype=dtype)


class Float8FeedForward(nn.Module):
    """The lesson's FeedForward with float8 projections, on CUDA in one process: SwiGLU and down's
    per-token quantization in one kernel (features/fp8/swiglu_quantize.py), which reads gate/up's
    output once, where the compiled code made three kernels of it. Up to 256 rows gate/up runs
    cuBLAS's unit-scale kernel, as every projection does, and the SwiGLU kernel applies its
    scales."""

    def __init__(self, w_gate_up: Float8Linear, w_down: Float8Linear):
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]."""
        from features.fp8.swiglu_quantize import swiglu_quantize  # Triton: CUDA machines only
        x8, x_scale = quantize_rows(x)
        gate_up = self.w_gate_up
        if x8.shape[0] <= SCALES_AFTER_MAX_ROWS:  # gate/up's scales in the kernel after it too
            h8, h_scale = swiglu_quantize(gate_up.sums(x8, x.dtype), x_scale, gate_up.scale)
        else:
            h8, h_scale = swiglu_quantize(gate_up.multiply(x8, x_scale, x.dtype))
        return self.w_down.multiply(h8, h_scale, x.dtype)  # h8: [T, ffn_dim], h_scale: [T, 1]


def reference_matmul(x8, x_scale, w8, w_scale) -> torch.Tensor:
    """What _scaled_mm computes, in float32: (x8 * x_scale) @ (w8 * w_scale^T)^T. x8: [T, in],
    x_scale: [T, 1], w8: [out, in], w_scale: [1, out] -> [T, out] float32."""
    return (x8.float() @ w8.float().t()) * x_scale * w_scale


def quantize_weights(model, group=None) -> tuple[int, int]:
    """Every projection of every layer in float8, each replaced as it is quantized, so that the
    16-bit copy of one matrix at most is alive beside the float8 ones. Returns the weights'
    bytes before and after (tied weights counted once). group: the processes the model is split
    over (the process-group seam's; None: one), so o and down hold input slices."""
    before = sum(p.nbytes for p in model.parameters())
    for layer in model.layers:
        # o and down write the residual stream: under torchrun their inputs are sliced
        for block, name, sliced_input in ((layer.attention, "wqkv", False),
                                          (layer.attention, "wo", True),
                                          (layer.feed_forward, "w_gate_up", False),
                                          (layer.feed_forward, "w_down", True)):
            setattr(block, name, Float8Linear(getattr(block, name),
                                              group if sliced_input else None))
        # On CUDA SwiGLU and down's quantization in one kernel; not under torchrun, where a row
        # of down's input is sliced over the processes and its largest value is over them all
        down = layer.feed_forward.w_down
        if down.uses_scaled_mm and group is None:
            layer.feed_forward = Float8FeedForward(layer.feed_forward.w_gate_up, down)
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the 16-bit matrices' memory back to the GPU, for the pool
    return before, sum(p.nbytes for p in model.parameters())
