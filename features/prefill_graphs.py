"""Short prefill passes as CUDA graphs: one launch where Python launched some 700 kernels.

Decode steps replay CUDA graphs (features/cuda_graphs.py); a prefill pass was launched kernel by
kernel from Python. A server's passes are short: a request or two that arrived during the last
step, a few hundred tokens. Launching such a pass took the host longer than the GPU's work on
it, so every new request's first token waited for Python (docs/serving-under-load.md). A graph of the pass launches in one call.

More in docs/engine-notes.md.
"""

import bisect
import contextlib

import numpy as np
import torch

from block_manager import to_device
from engine.attention_metadata import AttentionMetadata, Phase

BUCKETS = [16, 32, 64, 128] + list(range(192, 1025, 64))  # tokens of a pass that has a graph
MAX_PROMPTS = 16  # prompts of a pass that has a graph
LARGEST = BUCKETS[-1]
# A pass's inputs in one array, one copy to the device: tokens, positions and slots ([3, LARGEST]),
# the prompts' bounds (cu_seqlens) and where each prompt's last token is.
LAYOUT = (3 * LARGEST, MAX_PROMPTS + 2, MAX_PROMPTS)


def supports_prefill_graphs(cache) -> bool:
    """Whether a graph can record the cache's prefill: its attention reads the prompts' bounds
    on the GPU (flash-attn's varlen prefill; the PyTorch reference and the Triton prefill read
    them on the host)."""
    return cache.attention_backend.prefill_in_graphs


def padded_pass(tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                lengths: np.ndarray, bucket: int, spare_slot: int) -> np.ndarray:
    """A pass of len(lengths) prompts, T tokens, as the graph of `bucket` tokens reads it, in
    LAYOUT: tokens, positions and slots (the graph reads the first `bucket` of each); the
    prompts' bounds (cu_seqlens: the pass's prompts, the padding prompt, the empty ones); where
    each prompt's last token is (token 0 past the pass's own)."""
    total, num_prompts = len(tokens), len(lengths)
    inputs = np.zeros(sum(LAYOUT), dtype=np.int64)
    per_token, cu_seqlens, last_token_at = np.split(inputs, np.cumsum(LAYOUT)[:-1])  # views
    per_token = per_token.reshape(3, LARGEST)
    per_token[:, :total] = tokens, positions, slots
    per_token[2, total:] = spare_slot  # the padding prompt's K/V: written where no one reads
    cu_seqlens[1:num_prompts + 1] = np.cumsum(lengths)
    cu_seqlens[num_prompts + 1:] = bucket  # the padding prompt ends at the bucket; then empty ones
    last_token_at[:num_prompts] = cu_seqlens[1:num_prompts + 1] - 1
    return inputs


class GraphPrefill:
    """`engine.prefill_logits` (llama3_paged.py's Engine), recorded once per bucket; the passes
    it does not `replay` run as they are (engine/model_runner.py's `prefill_logits`). Captured
    after the decode graphs, the way they are (features/cuda_graphs.py)."""

    def __init__(self, engine):
        self.manager, self.cache = engine.manager, engine.cache
        # An FP8 cache (features/fp8/cache.py): its first pass sets the scales.
        self.float8 = float8 = self.cache.k[0].dtype == torch.float8_e4m3fn
        # The graphs' inputs: one buffer in LAYOUT, and views of it.
        self.inputs = torch.zeros(sum(LAYOUT), dtype=torch.long, device=engine.device)
        per_token, cu_seqlens, last_token_at = self.inputs.split(LAYOUT)
        tokens, positions, slots = per_token.view(3, LARGEST)

        def prefill(bucket):
            batch = AttentionMetadata(Phase.PREFILL, slots[:bucket], cu_seqlens.int(),
                                      max_seqlen=bucket)
            return engine.model(tokens[:bucket], positions[:bucket], self.cache, batch,
                                logits_at=last_token_at)  # [MAX_PROMPTS, vocab]

        nothing = np.zeros(0, dtype=np.int64)
        # The graphs record the passes after an FP8 cache's first, which quantize with the scales
        # that pass set (the first pass runs eagerly: `replays`).
        scaled = self.cache.as_if_scaled() if float8 else contextlib.nullcontext()
        with scaled, torch.inference_mode(), engine.model.at_any_length():
            self.graphs, self.logits_out, pool = {}, {}, None
            for bucket in reversed(BUCKETS):  # largest first: the smaller reuse its memory
                padding_alone = padded_pass(nothing, nothing, nothing, nothing, bucket,
                                            self.cache.spare_slot)
                self.inputs.copy_(torch.from_numpy(padding_alone))
                prefill(bucket)  # eagerly first: kernels loaded, the layers compiled
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits_out[bucket] = prefill(bucket)
                self.graphs[bucket], pool = graph, graph.pool()

    def replays(self, prompts: list[list[int]]) -> bool:
        """Whether a graph runs this pass."""
        return (sum(map(len, prompts)) <= LARGEST and len(prompts) <= MAX_PROMPTS
                and not (self.float8 and not all(self.cache.scaled)))

    def logits(self, rows: np.ndarray, prompts: list[list[int]]) -> torch.Tensor:
        """Same contract as Engine.prefill_logits, for a pass the graphs replay: [B, vocab],
        each prompt's last token's."""
        lengths = np.array([len(p) for p in prompts])
        total = int(lengths.sum())
        bucket = BUCKETS[bisect.bisect_left(BUCKETS, total)]
        positions = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [T]
        slots = self.manager.slots(np.repeat(rows, lengths), positions)  # as decode finds them
        self.inputs.copy_(to_device(padded_pass(np.concatenate(prompts), positions, slots, lengths,
                                                bucket, self.cache.spare_slot), self.inputs.device))
        self.graphs[bucket].replay()
        # A copy: the next replay of this graph overwrites its output.
        return self.logits_out[bucket][:len(prompts)].clone()
