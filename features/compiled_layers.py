"""Fused elementwise work (--compile, CUDA only): torch.compile around the attention call.

A decode step at batch 256 spends most of its time in the matmuls and the attention kernel, but
each layer also launches about a dozen small kernels between them: RMSNorm, RoPE's cast,
multiply and cast back, the residual adds, SiLU and its multiply. Each reads and writes the
whole activation, and at these sizes each costs a few microseconds whatever it does. Inductor
(torch.compile) fuses runs of them into one generated Triton kernel each: the residual add with
the next RMSNorm, RoPE into one, SiLU with its multiply. nano-vllm compiles the same pieces.

The attention call itself is left out (`torch.compiler.disable`): the cache's writes and the
flash-attn or Triton kernel run as they are, and each layer compiles into two graphs, the work
before attention and the work after it. The layers share their compiled code; batch sizes are
dynamic, so one compilation serves every CUDA-graph bucket (features/cuda_graphs.py warms each
bucket up before capturing it, so that nothing compiles during a capture).

Fused kernels round in other places than the eager ones (inductor keeps intermediates in
float32), so in bf16 tokens can differ from the eager path's; in float32 they agree.
"""

import torch


def compile_layers(model, cache) -> None:
    """Compile each transformer layer of `model` in place, with `cache`'s attention left out."""
    cache.attention = torch.compiler.disable(cache.attention)  # this instance only
    # One code object serves every layer, but each layer's index is a constant in its guards.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                4 * len(model.layers))
    for layer in model.layers:
        layer.compile(dynamic=True)
