"""Fused elementwise work (--compile, CUDA only): torch.compile around the attention call.

A decode step at batch 256 spends most of its time in the matmuls and the attention kernel, but
each layer also launches about a dozen small kernels between them: RMSNorm, RoPE's cast,
multiply and cast back, the residual adds, SiLU and its multiply. Each reads and writes the
whole activation, and at these sizes each costs a few microseconds whatever it does. Inductor
(torch.compile) fuses runs of them into one generated Triton kernel each: the residual add with
the next RMSNorm, SiLU with its multiply; RoPE's casts and rotation become one kernel of ours
(below). nano-vllm compiles the same pieces.

More in docs/engine-notes.md.
"""

import warnings

import torch

from llama3_paged import apply_rope

COMPILED_FROM_TOKENS = 1000  # a prefill pass launched from Python shorter than this runs eagerly
COMPILED_FROM_ROWS = 600  # and so does a decode step of fewer rows


# An opaque custom op: the compiled layers call the kernel as it is, between inductor's kernels.
@torch.library.custom_op("compiled_layers::rope", mutates_args=())
def rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    from engine.rope_kernel import rotate_pairs  # here: Triton, which CUDA machines have
    return rotate_pairs(x, rotations)


@rope.register_fake
def _(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """What the compiler traces: the output's shape and dtype."""
    return x.new_empty(x.shape)


@torch.compiler.substitute_in_graph(apply_rope)
def apply_rope_compiled(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """apply_rope as the compiler sees it: one Triton kernel, so that inductor neither meets
    complex numbers nor generates a kernel of its own for the pairs."""
    return rope(x, rotations)


def compile_layers(model) -> None:
    """Compile each transformer layer of `model` in place (engine/model_runner.py's ModelForward,
    made `compiled`, runs them inside `compiler_settings`). The engine's caches leave the
    attention call out of the graphs."""
    # The rotations still enter the compiled code as complex numbers, handed whole to the RoPE
    # kernel, yet inductor warns that it runs complex code slowly.
    warnings.filterwarnings("ignore", "Torchinductor does not support code generation for complex")
    for layer in model.layers:
        layer.compile(dynamic=True)


def compiler_settings():
    """Dynamo's settings for the compiled layers, in force only while they run (a context
    manager; torch's own settings are as they were outside it)."""
    return torch._dynamo.config.patch(
        # Every layer runs the same code and differs only in its weights and its index (which
        # layer's K/V it attends). Dynamo makes an int attribute a constant and guards it: each
        # layer would compile again for its own index (docs/speed.md). Read as an input, one
        # graph serves all.
        allow_unspec_int_on_nn_module=True,
        # Each other model compiled in the same process (a dtype, FP8 weights, a cache) adds
        # graphs, and past dynamo's limit (8) it would run the layers eagerly, with one warning.
        recompile_limit=64)


def warm_up_prompts(compiled: bool, manager, max_seq_len: int,
                    new_tokens: int) -> list[list[list[int]]]:
    """Prompts to prefill before anything is timed, one pass per list: a short one, and compiled,
    a long one alone and two together (the compiler tells a count of one apart from others), so
    that nothing compiles while requests wait. Each leaves room for its `new_tokens` within
    max_seq_len, and two of them take at most half of `manager`'s pool; none if it is too small."""
    fits_twice = (manager.num_blocks // 2 - 1) * manager.block_size - new_tokens
    longest = min(max_seq_len - new_tokens - 1, fits_twice)
    if longest < 1:
        return []
    short, long = [1] * min(32, longest), [1] * min(COMPILED_FROM_TOKENS, longest)
    return [[short]] + ([[long], [long, long]] if compiled else [])
