"""Cascade attention: a shared prefix read once per decode step, not once per request.

The prefix cache (prefix_cache.py) stores a system prompt's K/V once, in blocks every request's
table lists first. Memory is shared; bandwidth is not: the paged kernel follows each request's
table, so a decode step of B requests reads the system prompt's blocks B times. With the
1,056-token system prompt that is 138 MB per request per step.

More in docs/engine-notes.md.
"""

import contextlib
import dataclasses

import torch


# When the cascade pays (tools/cascade_cost.py, docs/sharing.md): its two kernels and the merge
# cost more than the plain kernel's reads of the prefix until the batch x the prefix reaches some
# 32K tokens (a batch of 32 for a prefix of 1,024 tokens).
MIN_SHARED_TOKENS_READ = 32_768


def merge(out_shared, lse_shared, out_own, lse_own) -> torch.Tensor:
    """Two softmaxes over disjoint keys as one. out_*: [B, n_heads, d]; lse_*: [B, n_heads], fp32.
    The shared part's weight, e^lse_shared / (e^lse_shared + e^lse_own), is
    sigmoid(lse_shared - lse_own): no exponential of an lse itself, so nothing overflows.
    (cascade_merge.py does the same in one Triton kernel, for the GPU.)"""
    w = torch.sigmoid(lse_shared - lse_own)[..., None]  # [B, n_heads, 1]
    return torch.lerp(out_own.float(), out_shared.float(), w).to(out_own.dtype)


class FlashParts:
    """The two parts through flash-attn's paged kernel, which returns each softmax's lse."""

    def __init__(self, prefix_tokens: int, device):
        from flash_attn import flash_attn_with_kvcache

        from features.cascade.merge import fused_merge
        self.with_kvcache, self.merge = flash_attn_with_kvcache, fused_merge
        # The prefix as a sequence of one: [1], on the GPU, where a CUDA graph reads it.
        self.prefix_tokens = torch.full((1,), prefix_tokens, dtype=torch.int32, device=device)

    def shared(self, q, key_blocks, value_blocks, prefix_table):
        out, lse = self.with_kvcache(q[None], key_blocks, value_blocks,  # [1, B, n_heads, d]
                                     cache_seqlens=self.prefix_tokens, block_table=prefix_table,
                                     causal=False, return_softmax_lse=True)
        return out[0], lse[0].T  # [B, n_heads, d], [B, n_heads]

    def own(self, q, key_blocks, value_blocks, batch):
        out, lse = self.with_kvcache(q[:, None], key_blocks, value_blocks,  # [B, 1, n_heads, d]
                                     cache_seqlens=batch.cache_seqlens,
                                     block_table=batch.block_table, causal=True,
                                     return_softmax_lse=True)
        return out[:, 0], lse[:, :, 0]


class TorchParts:
    """The same two parts written out in float32: the tests' reference. (Its gather of a
    request's blocks is TorchAttention.decode's; SDPA there returns no lse.)"""

    merge = staticmethod(merge)

    @staticmethod
    def _attend(q, k, v, holds_token):
        """q: [B, n_heads, d]; k, v: [B, L, n_kv_heads, d]; holds_token: [B, L] -> out, lse."""
        batch, n_heads, d = q.shape
        group = n_heads // k.shape[2]
        q = q.float().view(batch, k.shape[2], group, d)  # the query heads of each KV head
        scores = torch.einsum("bhgd,blhd->bhgl", q, k.float()) * d ** -0.5
        scores = scores.masked_fill(~holds_token[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [B, n_kv_heads, group]
        out = torch.einsum("bhgl,blhd->bhgd", torch.exp(scores - lse[..., None]), v.float())
        return out.reshape(batch, n_heads, d).to(v.dtype), lse.reshape(batch, n_heads)

    def shared(self, q, key_blocks, value_blocks, prefix_table):
        k, v = (blocks[prefix_table[0]].flatten(0, 1)[None].expand(len(q), -1, -1, -1)
                for blocks in (key_blocks, value_blocks))  # [B, prefix, n_kv_heads, d]
        holds_token = torch.ones(k.shape[:2], dtype=torch.bool, device=q.device)
        return self._attend(q, k, v, holds_token)

    def own(self, q, key_blocks, value_blocks, batch):
        block_size = key_blocks.shape[1]
        width = -(-batch.max_cache_seqlen // block_size) * block_size
        table = batch.block_table[:, :width // block_size]
        k, v = (blocks[table].flatten(1, 2) for blocks in (key_blocks, value_blocks))
        holds_token = torch.arange(width, device=q.device) < batch.cache_seqlens[:, None]
        return self._attend(q, k, v, holds_token)


class CascadeAttention:
    """An attention backend (flash-attn, or the PyTorch reference) whose decode is a cascade while
    `active`, for batches of `min_batch` or more: prefill is the backend's own. `table`: the block
    table's host copy, which `shared_by` reads before each decode step."""

    prefill_in_graphs = False  # prefill graphs are not recorded under a cascade

    def __init__(self, backend, prefix_blocks: int, block_size: int, device, min_batch: int,
                 table=None):
        self.backend, self.name, self.table = backend, backend.name, table
        self.prefix_blocks, self.prefix_tokens = prefix_blocks, prefix_blocks * block_size
        self.parts = (FlashParts(self.prefix_tokens, device) if backend.name == "flash"
                      else TorchParts())
        self.min_batch, self.active = min_batch, True
        # A static buffer, so that CUDA graphs replay with the current prefix's blocks: [1, P].
        self.prefix_table = torch.zeros(1, prefix_blocks, dtype=torch.int32, device=device)
        self.prefix = None  # the blocks prefix_table holds now
        self.num_steps = self.num_sharing_steps = 0  # decode steps; those whose rows all shared

    def shared_by(self, rows) -> bool:
        """Before each decode step, on the host: do all its rows list the same first P blocks?
        Then the cascade reads those. If not (no request holds the prefix in the cache yet, or
        a request was admitted before it was cached), the step runs eagerly without it
        (engine/model_runner.py's `decode_rows`, inside `set_aside`)."""
        first = self.table[rows, :self.prefix_blocks]  # [B, P]
        self.num_steps += 1
        if not (first == first[0]).all():
            return False
        if self.prefix is None or (first[0] != self.prefix).any():
            self.prefix = first[0].copy()
            self.prefix_table.copy_(torch.from_numpy(self.prefix)[None])
        self.num_sharing_steps += 1
        return True

    @contextlib.contextmanager
    def set_aside(self):
        """Inside, decode is the backend's own."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def prefill(self, q, k, v, batch):
        return self.backend.prefill(q, k, v, batch)

    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch):
        return self.backend.prefill_after_prefix(q, key_blocks, value_blocks, batch)

    def decode(self, q, key_blocks, value_blocks, batch):
        if not self.active or len(q) < self.min_batch:
            return self.backend.decode(q, key_blocks, value_blocks, batch)
        shared = self.parts.shared(q, key_blocks, value_blocks, self.prefix_table)
        # Every request has tokens after the prefix (its own turn, its last token); padding
        # rows of a CUDA graph (cache_seqlens 1) read one slot of the batch's first request.
        own = dataclasses.replace(
            batch, block_table=batch.block_table[:, self.prefix_blocks:],
            cache_seqlens=(batch.cache_seqlens - self.prefix_tokens).clamp(min=1),
            max_cache_seqlen=max(batch.max_cache_seqlen - self.prefix_tokens, 1))
        return self.parts.merge(*shared, *self.parts.own(q, key_blocks, value_blocks, own))


def cascade_for(setup, cache, manager) -> CascadeAttention | None:
    """The cascade a run whose prefix cache shares a system prompt gets, printing the rule it was
    chosen by (engine/build.py's make_runner asks only then). --cascade auto: the prompt's full blocks, read by
    flash-attn, for batches of MIN_SHARED_TOKENS_READ / prefix tokens or more. --cascade on forces
    it for every batch (flash-attn or the reference)."""
    mode, prefix_tokens = setup.args.cascade, setup.num_system_prompt_tokens
    prefix_blocks = prefix_tokens // cache.block_size
    shared_tokens = prefix_blocks * cache.block_size
    backend = cache.attention_backend.name
    why_not = ("the system prompt fills no whole block" if prefix_blocks == 0 else
               "the FP8 cache: the cascade's kernels read 16-bit blocks"
               if cache.k.dtype == torch.float8_e4m3fn else
               f"--attn {backend}: the cascade's shared part needs flash-attn's kernel of many "
               f"queries over one sequence" if backend != "flash" and mode != "on" else "")
    if why_not:
        print(f"Cascade attention: off ({why_not}).")
        return None
    min_batch = 1 if mode == "on" else -(-MIN_SHARED_TOKENS_READ // shared_tokens)
    when = ("every decode step (--cascade on)" if mode == "on" else
            f"decode steps of {min_batch} requests or more (the rule measured by "
            f"tools/cascade_cost.py: batch x shared tokens at least {MIN_SHARED_TOKENS_READ:,})")
    print(f"Cascade attention: the system prompt's first {shared_tokens:,} tokens "
          f"({prefix_blocks} blocks) read once per step in {when}.")
    cascade = CascadeAttention(cache.attention_backend, prefix_blocks, cache.block_size,
                               manager.block_table.device, min_batch, manager.table)
    cache.attend_with(cascade)
    return cascade
