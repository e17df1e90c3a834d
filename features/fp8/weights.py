"""FP8 weights (--quantization fp8): the projections in float8, half their bf16 bytes.

The lesson's levers shrink the KV cache; on a 24 GB card the weights are the larger share
(Llama 3 8B: 16 GB in bf16). In float8 e4m3 the projections take half, the pool gets what they
free, and every decode step, which reads every weight once, reads half as many bytes; Hopper's
float8 tensor cores also multiply at twice bf16's rate. This is vLLM's `--quantization fp8`:

- Weights: each output channel (a row of a projection's [out, in] matrix) gets its own float32
  scale, its largest |w| over 448 (e4m3's largest value), so that every row uses the format's
  whole range. Quantized once, at load, from whatever the loader filled (a checkpoint, random
  weights): q/k/v, o, gate/up and down. The embedding and the output head stay 16-bit, as
  vLLM's do: the head's errors go straight into the logits.
- Activations: scaled per token (a row of x) at run time, the same way, just before each
  matmul; compiled layers (engine/compiled_layers.py) fuse that into the kernels around it.
- The matmul: on CUDA `torch._scaled_mm`, float8 x float8 with both rows' scales, accumulated in
  float32 and written in bf16. Elsewhere (the CPU, float32 runs) the reference below: the same
  quantized numbers, dequantized, multiplied in float32. CI tests the numerics through it; the
  GPU tests hold `_scaled_mm` to it.

Like gpt-fast's quantize.py, this transforms a loaded model from outside, in one place
(engine/loader.py): `quantize_weights` replaces each projection's nn.Linear by a Float8Linear.
The lesson's layers call `self.wqkv(x)` as before and know nothing of it.
"""

import torch
from torch import nn

from features.fp8.cache import FP8, FP8_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] -> (x / scale in float8 [rows, n], scale [rows, 1] float32), each row's
    scale its largest |value| over FP8_MAX (a row of zeros: a tiny scale, zeros stay zeros)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Float8Linear(nn.Module):
    """y = x W^T with W in float8 and a scale per output channel; x quantized per token."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight, scale = quantize_rows(linear.weight.detach())  # [out, in], [out, 1]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale.t().contiguous(), requires_grad=False)  # [1, out]
        # _scaled_mm multiplies float8 on CUDA and writes bf16 with row-wise scales
        self.uses_scaled_mm = weight.is_cuda and linear.weight.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out], in x's dtype."""
        x8, x_scale = quantize_rows(x)  # [T, in] float8, [T, 1]
        if self.uses_scaled_mm:
            # weight.t() is [in, out] column-major: the layout the float8 tensor cores read
            return torch._scaled_mm(x8, self.weight.t(), scale_a=x_scale, scale_b=self.scale,
                                    out_dtype=x.dtype)
        return reference_matmul(x8, x_scale, self.weight, self.scale).to(x.dtype)


def reference_matmul(x8, x_scale, w8, w_scale) -> torch.Tensor:
    """What _scaled_mm computes, in float32: (x8 * x_scale) @ (w8 * w_scale^T)^T. x8: [T, in],
    x_scale: [T, 1], w8: [out, in], w_scale: [1, out] -> [T, out] float32."""
    return (x8.float() @ w8.float().t()) * x_scale * w_scale


def quantize_weights(model) -> tuple[int, int]:
    """Every projection of every layer in float8, each replaced as it is quantized, so that the
    16-bit copy of one matrix at most is alive beside the float8 ones. Returns the weights'
    bytes before and after (tied weights counted once)."""
    before = sum(p.nbytes for p in model.parameters())
    for layer in model.layers:
        for block, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                            (layer.feed_forward, "w_gate_up"), (layer.feed_forward, "w_down")):
            setattr(block, name, Float8Linear(getattr(block, name)))
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the 16-bit matrices' memory back to the GPU, for the pool
    return before, sum(p.nbytes for p in model.parameters())
