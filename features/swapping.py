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

import numpy as np
import torch

from features.continuous import ContinuousScheduler
from features.page_manager import consecutive_runs


class HostBlocks:
    """A pool of KV blocks in host memory: K and V each `[num_blocks, n_layers, block_size,
    n_kv_heads, head_dim]`. Blocks outermost, unlike the cache, so that a block's K (or V) of
    every layer is one stretch of memory, and a run of consecutive host blocks is one transfer.

    Copies are queued by `copy_out` and `copy_in` and made by `flush`, once per step, in the
    order they were queued: consecutive copies of one direction, every victim of the step, make
    one gather on the GPU and one transfer per run of consecutive host blocks, not one per block
    and layer."""

    def __init__(self, cache, num_blocks: int):
        n_layers, _, n_kv_heads, head_dim = cache.k.shape
        shape = (num_blocks, n_layers, cache.block_size, n_kv_heads, head_dim)
        pin = cache.k.device.type == "cuda"  # pinned: the GPU copies it without a bounce buffer
        self.k = torch.zeros(shape, dtype=cache.k.dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=cache.v.dtype, pin_memory=pin)
        self.free = list(range(num_blocks))
        self.cache_k, self.cache_v = (t[:, :cache.num_slots].view(n_layers, -1, *shape[2:])
                                      for t in (cache.k, cache.v))  # the cache as blocks
        self.queued: list[tuple[str, list[int], list[int]]] = []  # (direction, cache, host)

    def copy_out(self, blocks: list[int]) -> list[int] | None:
        """Queue a copy of cache blocks here; None if too few host blocks are free. The lowest
        free ones are taken, so that they mostly run consecutively."""
        if len(blocks) > len(self.free):
            return None
        self.free.sort()
        host, self.free = self.free[:len(blocks)], self.free[len(blocks):]
        self.queued.append(("out", list(blocks), host))  # a copy: the manager's list changes
        return host

    def copy_in(self, host: list[int], blocks: list[int]) -> None:
        """Queue a copy of host blocks back into cache blocks, and free them here (a later copy
        out into them is made after this one, in queue order)."""
        self.queued.append(("in", list(blocks), host))
        self.free += host

    def flush(self) -> None:
        """Make the queued copies, asynchronously on the current stream, before the step runs."""
        groups = []  # consecutive copies of one direction, merged
        for direction, blocks, host in self.queued:
            if groups and groups[-1][0] == direction:
                groups[-1][1].extend(blocks), groups[-1][2].extend(host)
            else:
                groups.append((direction, list(blocks), list(host)))
        self.queued = []
        for direction, blocks, host in groups:
            index = torch.tensor(blocks, device=self.cache_k.device)
            runs = consecutive_runs(np.zeros(len(host)), np.array(host))
            for mine, theirs in ((self.k, self.cache_k), (self.v, self.cache_v)):
                if direction == "out":  # gather [n, n_layers, block_size, ...] on the GPU
                    staged = theirs[:, index].transpose(0, 1).contiguous()
                    for start, end in runs:
                        mine[host[start]:host[start] + end - start].copy_(
                            staged[start:end], non_blocking=True)
                else:
                    staged = torch.empty((len(blocks), theirs.shape[0], *theirs.shape[2:]),
                                         dtype=theirs.dtype, device=theirs.device)
                    for start, end in runs:
                        staged[start:end].copy_(mine[host[start]:host[start] + end - start],
                                                non_blocking=True)
                    theirs[:, index] = staged.transpose(0, 1)


class SwappingScheduler(ContinuousScheduler):
    def __init__(self, manager, requests: list, max_running: int | None, chunk_tokens: int,
                 cache, swap_blocks: int):
        super().__init__(manager, requests, max_running, chunk_tokens)
        self.host = HostBlocks(cache, swap_blocks)
        self.swapped: dict = {}  # request -> its blocks in host memory

    def schedule(self):
        """The step, with the K/V copies its preemptions and returns queued made before it runs."""
        step = super().schedule()
        self.host.flush()
        return step

    def _keep(self, victim) -> None:
        """Copy the victim's K/V to host memory if it is decoding and there is room there."""
        decoding = self.manager.num_tokens[victim.row] == victim.num_tokens - 1
        host = self.host.copy_out(self.manager.owned_blocks[victim.row]) if decoding else None
        if host is None:
            return super()._keep(victim)  # recompute
        self.swapped[victim] = host
        self.num_swapped += 1

    def _allocate(self, request) -> int:
        """A swapped request takes blocks for all its tokens but the last (whose K/V its next
        decode step computes, as before it left) and gets its K/V back: nothing to prefill."""
        host = self.swapped.pop(request, None)
        if host is None:
            return super()._allocate(request)
        cached = request.num_tokens - 1
        self.manager.allocate(SimpleNamespace(row=request.row, tokens=request.tokens[:-1]))
        self.host.copy_in(host, self.manager.owned_blocks[request.row])
        return cached
