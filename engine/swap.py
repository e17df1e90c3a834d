"""The host pool that preemption by swapping copies to (`--preemption swap`).

The PagedAttention paper (section 4.5) gives two ways to preempt. Recompute: the victim's blocks
are freed and, when it returns, its prompt and generated tokens are prefilled again. Swap: its
blocks are first copied to a pool of blocks in host memory (`--swap-space`, pinned on a GPU so
that the copies run at the link's speed), and copied back into new blocks when it returns; it
then rejoins the decode batch where it stopped, with no prefill. The K/V it continues from are
the very ones it left with, so its tokens are those of a run without preemption, in any
precision (a recomputed prefill rounds differently from the decode steps it replaces). The
scheduler (engine/scheduler.py) chooses who goes and comes back; this file moves their blocks.
"""

import numpy as np
import torch


def consecutive_runs(rows: np.ndarray, columns: np.ndarray):
    """(start, end) of each run of entries on one row in consecutive columns: blocks that one
    copy moves at once (and pages that one driver call maps, features/virtual/mapping_ahead.py)."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero((np.diff(rows) != 0) | (np.diff(columns) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(rows)]
    return list(zip(bounds[:-1], bounds[1:]))


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

    def release(self, host: list[int]) -> None:
        """Host blocks whose request ended while swapped out: free, their K/V never copied back
        (a later copy out into them is made after any queued one, in queue order)."""
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
