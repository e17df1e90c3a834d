"""Preemption by swapping (--preemption swap): a preempted request's K/V go to host memory.

The PagedAttention paper (section 4.5) gives two ways to preempt. Recompute, features/
continuous.py's: the victim's blocks are freed and, when it returns, its prompt and generated
tokens are prefilled again. Swap, this file's: its blocks are first copied to a pool of blocks in
host memory (`--swap-space`, pinned on a GPU so that the copies run at the link's speed), and
copied back into new blocks when it returns; it then rejoins the decode batch where it stopped,
with no prefill. The K/V it continues from are the very ones it left with, so its tokens are
those of a run without preemption, in any precision (a recomputed prefill rounds differently
from the decode steps it replaces). A victim that finds too few host blocks free, or that is
halfway through its prompt (mixed steps), is recomputed instead.
"""

from types import SimpleNamespace

import torch

from features.continuous import ContinuousScheduler


class HostBlocks:
    """A pool of KV blocks in host memory, shaped as the cache's: [n_layers, blocks, block_size,
    n_kv_heads, head_dim] for K and for V."""

    def __init__(self, cache, num_blocks: int):
        n_layers, _, n_kv_heads, head_dim = cache.k.shape
        shape = (n_layers, num_blocks, cache.block_size, n_kv_heads, head_dim)
        pin = cache.k.device.type == "cuda"
        self.k = torch.zeros(shape, dtype=cache.k.dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=cache.v.dtype, pin_memory=pin)
        self.free = list(range(num_blocks))
        self.cache_k, self.cache_v = (t[:, :cache.spare_slot].view(n_layers, -1, *shape[2:])
                                      for t in (cache.k, cache.v))  # the cache as blocks

    def copy_out(self, blocks: list[int]) -> list[int] | None:
        """Copy cache blocks here, one copy for K and one for V; None if too few are free."""
        if len(blocks) > len(self.free):
            return None
        host = [self.free.pop() for _ in blocks]
        index = torch.tensor(blocks, device=self.cache_k.device)
        for mine, theirs in ((self.k, self.cache_k), (self.v, self.cache_v)):
            mine[:, host] = theirs[:, index].cpu()
        return host

    def copy_in(self, host: list[int], blocks: list[int]) -> None:
        """Copy host blocks back into cache blocks, and free them here."""
        index = torch.tensor(blocks, device=self.cache_k.device)
        for mine, theirs in ((self.k, self.cache_k), (self.v, self.cache_v)):
            theirs[:, index] = mine[:, host].to(theirs.device, non_blocking=True)
        self.free += host


class SwappingScheduler(ContinuousScheduler):
    def __init__(self, manager, requests: list, max_running: int | None, chunk_tokens: int,
                 cache, swap_blocks: int):
        super().__init__(manager, requests, max_running, chunk_tokens)
        self.host = HostBlocks(cache, swap_blocks)
        self.swapped: dict = {}  # request -> its blocks in host memory
        self.num_swapped = 0

    def _keep(self, victim) -> None:
        """Copy the victim's K/V to host memory if it is decoding and there is room there."""
        decoding = self.manager.num_tokens[victim.row] == victim.num_tokens - 1
        host = self.host.copy_out(self.manager.owned_blocks[victim.row]) if decoding else None
        if host is None:
            return super()._keep(victim)  # recompute
        self.swapped[victim] = host
        self.num_swapped += 1

    def _allocate(self, request) -> int:
        """A swapped request takes blocks for all its tokens but the newest (whose K/V its next
        decode step computes, as before it left) and gets its K/V back: nothing to prefill."""
        host = self.swapped.pop(request, None)
        if host is None:
            return super()._allocate(request)
        cached = request.num_tokens - 1
        self.manager.allocate(SimpleNamespace(row=request.row, tokens=request.tokens[:-1]))
        self.host.copy_in(host, self.manager.owned_blocks[request.row])
        return cached
