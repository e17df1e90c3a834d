"""Attention over a block-table KV cache, three ways: the PyTorch reference, flash-attn, and a
Triton kernel (`triton_attention.py`) for GPUs without flash-attn.

Both read the same pool, `[num_blocks, block_size, n_kv_heads, head_dim]` per layer, through the
same `block_table` (`[batch, max_blocks]`: row r lists the physical blocks of request r, in order)
and `cache_seqlens` (`[batch]`: how many of those slots hold tokens).
"""

import importlib
import math

import torch
import torch.nn.functional as F

from engine.errors import UserError

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2's paged kernel reads the cache in 256-token pages


class TorchAttention:
    """Readable and slow: gathers every request's blocks into a dense tensor, then runs SDPA.
    It runs anywhere (CPU included) and is the oracle the tests hold flash-attn to."""

    name = "torch"
    cuda_graphs = False  # its gather is sized by the longest request, a number on the host

    def prefill(self, q, k, v, batch):
        """Causal attention within each packed prompt. q: [T, n_heads, d]; k, v: [T, n_kv_heads, d].
        Prompts start with an empty cache, so the fresh k and v are all there is to attend to."""
        out = torch.empty_like(q)
        bounds = batch.cu_seqlens_host
        for start, end in zip(bounds[:-1], bounds[1:]):
            q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, len, d]
            out[start:end] = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=True, enable_gqa=True).transpose(0, 1)
        return out

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch):
        """Prompts whose first tokens were cached already (prefix caching): q holds the rest of
        each, and every token, cached or new, is read from the pool. Query i of a prompt with
        n_k tokens of which n_q are in q sits at position n_k - n_q + i and sees keys up to it."""
        out = torch.empty_like(q)
        q_bounds, k_bounds = batch.cu_seqlens_host, batch.cu_seqlens_k_host
        block_size = key_blocks.shape[1]
        for r, (start, end) in enumerate(zip(q_bounds[:-1], q_bounds[1:])):
            n_q, n_k = end - start, k_bounds[r + 1] - k_bounds[r]
            table = batch.block_table[r, :math.ceil(n_k / block_size)]
            k = key_blocks[table].flatten(0, 1)[:n_k].transpose(0, 1)  # [n_kv_heads, n_k, d]
            v = value_blocks[table].flatten(0, 1)[:n_k].transpose(0, 1)
            sees = (torch.arange(n_k, device=q.device)[None, :]
                    <= torch.arange(n_k - n_q, n_k, device=q.device)[:, None])  # [n_q, n_k]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k, v, attn_mask=sees, enable_gqa=True).transpose(0, 1)
        return out

    def decode(self, q, key_blocks, value_blocks, batch):
        """One new token per request. q: [B, n_heads, d] -> [B, n_heads, d]."""
        block_size = key_blocks.shape[1]
        max_len = batch.max_cache_seqlen  # known on the host: gather only blocks someone uses
        table = batch.block_table[:, :math.ceil(max_len / block_size)]
        k = key_blocks[table].flatten(1, 2)[:, :max_len]  # [B, max_len, n_kv_heads, d]
        v = value_blocks[table].flatten(1, 2)[:, :max_len]
        holds_token = torch.arange(max_len, device=q.device) < batch.cache_seqlens[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=holds_token[:, None, None, :], enable_gqa=True)  # [B, n_heads, 1, d]
        return out[:, :, 0]


class FlashAttention:
    """flash-attn 2: varlen prefill over the packed prompts; paged decode that follows
    block_table inside the kernel, reading each block once, never gathering."""

    name = "flash"
    cuda_graphs = True  # reads block_table and cache_seqlens on the GPU: no host numbers

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prefill(self, q, k, v, batch):
        return self.varlen(q, k, v, batch.cu_seqlens, batch.cu_seqlens,
                           batch.max_seqlen, batch.max_seqlen, causal=True)

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch):
        """The varlen kernel reads the cached prefix through the block table; its causal mask is
        aligned to the end of each prompt, so the new tokens see everything before them."""
        return self.varlen(q, key_blocks, value_blocks, batch.cu_seqlens, batch.cu_seqlens_k,
                           batch.max_seqlen, batch.max_seqlen_k, causal=True,
                           block_table=batch.block_table)

    def decode(self, q, key_blocks, value_blocks, batch):
        out = self.with_kvcache(q[:, None], key_blocks, value_blocks,  # q: [B, 1, n_heads, d]
                                cache_seqlens=batch.cache_seqlens, block_table=batch.block_table,
                                causal=True)
        return out[:, 0]


class TritonAttention:
    """Decode through the Triton kernel in triton_attention.py, which reads blocks of any
    power-of-two size from 16 up; prefill through PyTorch's SDPA on the packed prompts."""

    name = "triton"
    cuda_graphs = True  # the kernel reads block_table and cache_seqlens on the GPU

    def __init__(self):
        from engine.triton_attention import paged_decode
        self.paged_decode = paged_decode

    def prefill(self, q, k, v, batch):
        """One SDPA call for the whole chunk: the prompts as a nested (jagged) tensor, which
        PyTorch's fused kernels take on CUDA. They want as many K/V heads as query heads."""
        group = q.shape[1] // k.shape[1]
        offsets, bounds = batch.cu_seqlens.long(), batch.cu_seqlens_host
        shortest = min(end - start for start, end in zip(bounds[:-1], bounds[1:]))
        as_nested = lambda t: torch.nested.nested_tensor_from_jagged(  # [B, heads, length, d]
            t.contiguous(), offsets, min_seqlen=shortest, max_seqlen=batch.max_seqlen  # no sync
        ).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            as_nested(q), as_nested(k.repeat_interleave(group, 1)),
            as_nested(v.repeat_interleave(group, 1)), is_causal=True)
        return out.transpose(1, 2).values()  # [T, n_heads, d]

    # After a cached prefix, the reference's loop: the fused SDPA kernels' causal mask is aligned
    # to the first key, which is right only where a prompt has no cached tokens before its own.
    prefill_after_prefix = TorchAttention.prefill_after_prefix

    def decode(self, q, key_blocks, value_blocks, batch):
        return self.paged_decode(q, key_blocks, value_blocks, batch.block_table, batch.cache_seqlens)


def importable(module: str) -> bool:
    """Whether an optional package (flash_attn, triton) is installed and loads."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def choose_attention(name: str, device: torch.device):
    """`auto` takes flash-attn on CUDA when it imports, else the Triton kernel on CUDA, else the
    PyTorch reference."""
    if name == "auto":
        name = ("torch" if device.type != "cuda" else "flash" if importable("flash_attn")
                else "triton" if importable("triton") else "torch")
    if name == "torch":
        return TorchAttention()
    if device.type != "cuda":
        raise UserError(f"--attn {name} needs a CUDA device; use --attn torch on the CPU.")
    if name == "triton":
        if not importable("triton"):
            raise UserError("--attn triton: Triton is not installed (it comes with PyTorch's CUDA "
                            "builds); use --attn torch.")
        return TritonAttention()
    if not importable("flash_attn"):
        raise UserError("--attn flash: flash-attn is not installed. Install it after torch with "
                        "`pip install flash-attn --no-build-isolation`, or use --attn triton.")
    return FlashAttention()
