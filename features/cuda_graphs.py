"""Decode as CUDA graphs: one launch replays a whole step's ~550 kernels (8b model).

Eager decoding launches every kernel of every layer from Python. At small batches the GPU
finishes a kernel sooner than the host launches the next, so the step takes as long as the
launches. A CUDA graph records one step's kernels with their arguments and replays them all with
one call.

More in docs/engine-notes.md.
"""

import bisect

import numpy as np
import torch

from block_manager import to_device

# Batch sizes with a graph: vLLM's up to 512, then every 32 up to 1,024. Up to about 1,000 rows
# a step launched from Python is slower than its graph, the more so with float8 weights, whose
# kernels are shorter than their launches (docs/speed.md); past that a graph buys nothing.
BUCKETS = [1, 2, 4] + list(range(8, 513, 8)) + list(range(544, 1025, 32))


class GraphDecoder:
    """Records `eager.decode` (engine/model_runner.py's SamplingDecoder, over the engine's
    ModelForward) once per bucket. `eager_when(rows)`: the rows the graphs must not run, beside
    batches past the largest bucket (the API's: rows that sample, where the graphs record
    greedy decoding; a graph would have recorded one path for every row forever). pool: another
    decoder's memory pool, to share (features/logprobs/logprobs.py's graphs run one step at a time
    beside the plain ones, never at once)."""

    def __init__(self, eager, max_batch: int, eager_when=lambda rows: False, pool=None):
        self.eager_when = eager_when
        self.buckets = BUCKETS[:bisect.bisect_left(BUCKETS, max_batch) + 1]
        largest, device = self.buckets[-1], eager.block_table.device
        # The graphs' inputs: tokens, positions, rows and slots, [4, largest]. A step fills the
        # first B columns and pads the rest of its bucket (`_padded`); the bucket's graph reads no
        # further. The tokens are on the device already; the other three come in one copy.
        self.inputs = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.spare_slot = eager.cache.spare_slot
        self.inputs[3] = self.spare_slot
        # The attention kernel reads block_table and cache_seqlens on the GPU; the host-side
        # longest length would be frozen into the graph, so it is given as the table's width.
        max_cache_seqlen = eager.block_table.shape[1] * eager.cache.block_size

        def step(batch_size):
            return eager.decode(*self.inputs[:, :batch_size], max_cache_seqlen)

        with torch.inference_mode(), eager.model.at_any_length():  # compiled, if it is
            # One eager step first, so that kernels are loaded and cuBLAS has chosen its
            # algorithms before capture; then capture largest first, so that smaller graphs
            # reuse its memory pool. (No new side stream for the warm-up: cuBLAS keeps a
            # workspace per stream for good, which would leak with every decoder made.)
            step(largest)
            self.graphs, self.next_tokens = {}, {}
            for batch_size in reversed(self.buckets):
                step(batch_size)  # eagerly first: a compiled model (--compile) compiles here
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.next_tokens[batch_size] = step(batch_size)  # [batch_size], static
                self.graphs[batch_size], pool = graph, graph.pool()
        self.pool = pool

    def replays(self, rows: np.ndarray) -> bool:
        """Whether a graph runs this decode step."""
        return len(rows) <= self.buckets[-1] and not self.eager_when(rows)

    def step(self, tokens, positions, rows, slots) -> torch.Tensor:
        """Same contract as Decoder.step, for a batch the graphs replay."""
        batch = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        self.inputs[0, :batch] = tokens  # rows batch.. keep earlier tokens: any token will do
        self.inputs[1:] = to_device(self._padded(positions, rows, slots), self.inputs.device)
        self.graphs[bucket].replay()
        return self.next_tokens[bucket][:batch]

    def _padded(self, positions, rows, slots) -> np.ndarray:
        """Positions, rows and slots for all the inputs' columns, [3, largest]. Columns past
        the batch, up to its bucket, run too, and must change nothing: each writes its K/V to the
        cache's spare slot, and reads one token of the batch's first request, whose first block
        exists. Their outputs are ignored; the graph reads no column past its bucket."""
        padded = np.empty((3, self.inputs.shape[1]), dtype=np.int64)
        padded[:, len(rows):] = np.array([0, rows[0], self.spare_slot])[:, None]
        padded[:, :len(rows)] = positions, rows, slots
        return padded
