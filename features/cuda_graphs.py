"""Decode as CUDA graphs: one launch replays a whole step's ~550 kernels (8b model).

Eager decoding launches every kernel of every layer from Python. At small batches the GPU
finishes a kernel sooner than the host launches the next, so the step takes as long as the
launches. A CUDA graph records one step's kernels with their arguments and replays them all with
one call.

A graph replays exactly what it recorded: the same shapes, reading and writing the same
addresses. So the step's inputs live in static buffers that each step overwrites, and there is
one graph per batch-size bucket: a batch of 37 runs the bucket-40 graph with 3 padding rows, which
write to the cache's spare slot. The block table and the KV pool are already static: the block
manager edits the table in place. Batches above the largest bucket run eagerly;
their kernels are long enough to hide the launches.
"""

import bisect

import torch

BUCKETS = [1, 2, 4] + list(range(8, 513, 8))  # batch sizes with a graph, as vLLM captures


class GraphDecoder:
    """Records `eager.decode` (core/engine.py) once per bucket; runs larger batches eagerly."""

    def __init__(self, eager, max_batch: int):
        self.eager = eager
        self.buckets = BUCKETS[:bisect.bisect_left(BUCKETS, max_batch) + 1]
        largest, device = self.buckets[-1], eager.block_table.device
        # The graphs' inputs: tokens, positions, rows and slots, [4, largest]. A step fills the
        # first B columns and pads the rest of its bucket (`_pad`); the bucket's graph reads no
        # further. One pinned host buffer, so that one copy that does not wait moves them all.
        self.inputs = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.host_inputs = torch.zeros(4, largest, dtype=torch.long).pin_memory()
        self.spare_slot = eager.cache.spare_slot
        self.inputs[3] = self.spare_slot
        # The attention kernel reads block_table and cache_seqlens on the GPU; the host-side
        # longest length would be frozen into the graph, so it is given as the table's width.
        max_cache_seqlen = eager.block_table.shape[1] * eager.cache.block_size

        def step(batch_size):
            return eager.decode(*self.inputs[:, :batch_size], max_cache_seqlen)

        with torch.inference_mode():
            # One eager step first, so that kernels are loaded and cuBLAS has chosen its
            # algorithms before capture; then capture largest first, so that smaller graphs
            # reuse its memory pool. (No new side stream for the warm-up: cuBLAS keeps a
            # workspace per stream for good, which would leak with every decoder made.)
            step(largest)
            self.graphs, self.next_tokens, pool = {}, {}, None
            for batch_size in reversed(self.buckets):
                step(batch_size)  # eagerly first: a compiled model (--compile) compiles here
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.next_tokens[batch_size] = step(batch_size)  # [batch_size], static
                self.graphs[batch_size], pool = graph, graph.pool()

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        """Same contract as EagerDecoder.step."""
        batch = len(rows)
        if batch > self.buckets[-1]:
            return self.eager.step(tokens, positions, rows, slots)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        # Overwriting the pinned buffer is safe: the last step's copy finished before its
        # tokens reached the host.
        for i, values in enumerate((tokens, positions, rows, slots)):
            self.host_inputs[i, :batch] = torch.from_numpy(values)
        self._pad(batch, bucket, rows[0])
        self.inputs.copy_(self.host_inputs, non_blocking=True)  # all of it: one contiguous copy
        self.graphs[bucket].replay()
        return self.next_tokens[bucket][:batch]

    def _pad(self, batch: int, bucket: int, first_row: int) -> None:
        """Rows batch..bucket-1 run too, and must change nothing: each writes its K/V to the
        cache's spare slot, and reads one token of the batch's first request, whose first block
        exists. Their outputs are ignored."""
        self.host_inputs[:, batch:bucket] = torch.tensor([0, 0, first_row, self.spare_slot])[:, None]
