"""Decode as CUDA graphs: one launch replays a whole step's ~550 kernels (8b model).

Eager decoding launches every kernel of every layer from Python. At small batches the GPU
finishes a kernel sooner than the host launches the next, so the step takes as long as the
launches. A CUDA graph records one step's kernels with their arguments and replays them all with
one call.

A graph replays exactly what it recorded: the same shapes, reading and writing the same
addresses. So the step's inputs live in static buffers that each step overwrites, and there is
one graph per batch-size bucket: a batch of 37 runs the bucket-40 graph with 3 padding rows, which
`decode_step` sends to the cache's spare slot. The block table and the KV pool are already
static: the block manager edits the table in place. Batches above the largest bucket run eagerly;
their kernels are long enough to hide the launches.
"""

import bisect

import numpy as np
import torch

BUCKETS = [1, 2, 4] + list(range(8, 513, 8))  # batch sizes with a graph, as vLLM captures


class GraphDecoder:
    """Records `eager.decode` (generate.decode_step) once per bucket; runs larger batches eagerly."""

    def __init__(self, eager, max_batch: int):
        self.eager = eager
        self.buckets = BUCKETS[:bisect.bisect_left(BUCKETS, max_batch) + 1]
        largest, device = self.buckets[-1], eager.block_table.device
        # The graphs' inputs, [largest] each; a step fills the first B rows (or all of them).
        self.requests = torch.full((largest,), eager.padding_request, dtype=torch.long,
                                   device=device)  # all padding: the table row no one owns
        self.positions = torch.full((largest,), -1, dtype=torch.long, device=device)  # all padding
        self.tokens = torch.zeros(largest, dtype=torch.long, device=device)
        self.host_requests = torch.zeros(largest, dtype=torch.long).pin_memory()
        self.host_positions = torch.zeros(largest, dtype=torch.long).pin_memory()
        # The attention kernel reads block_table and cache_seqlens on the GPU; the host-side
        # longest length would be frozen into the graph, so it is given as the table's width.
        max_cache_seqlen = eager.block_table.shape[1] * eager.cache.block_size

        def step(batch_size):
            return eager.decode(self.tokens[:batch_size], self.positions[:batch_size],
                                self.requests[:batch_size], max_cache_seqlen)

        with torch.inference_mode():
            # One eager step first, so that kernels are loaded and cuBLAS has chosen its
            # algorithms before capture; then capture largest first, so that smaller graphs
            # reuse its memory pool. (No new side stream for the warm-up: cuBLAS keeps a
            # workspace per stream for good, which would leak with every decoder made.)
            step(largest)
            self.graphs, self.next_tokens, pool = {}, {}, None
            for batch_size in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.next_tokens[batch_size] = step(batch_size)  # [batch_size], static
                self.graphs[batch_size], pool = graph, graph.pool()

    def step(self, last_tokens, running: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Same contract as EagerDecoder.step."""
        batch = len(running)
        if batch > self.buckets[-1]:
            return self.eager.step(last_tokens, running, positions)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        # Pinned host buffers, so the copies below do not wait. Overwriting them is safe: the
        # last step's copies finished before its tokens reached the host.
        self.host_requests[:batch] = torch.from_numpy(running)
        self.host_requests[batch:bucket] = self.eager.padding_request  # a table row no one owns
        self.host_positions[:batch] = torch.from_numpy(positions)
        self.host_positions[batch:bucket] = -1  # padding: see decode_step
        self.requests[:bucket].copy_(self.host_requests[:bucket], non_blocking=True)
        self.positions[:bucket].copy_(self.host_positions[:bucket], non_blocking=True)
        requests = self.requests[:batch]
        torch.index_select(last_tokens, 0, requests, out=self.tokens[:batch])
        self.graphs[bucket].replay()
        next_tokens = self.next_tokens[bucket][:batch]
        last_tokens[requests] = next_tokens
        return next_tokens
