"""The engine's seams: the places a feature attaches, what each asks of it, and which feature
attaches where.

A feature is a file or folder of features/ that plugs into one seam. The engine reaches it only
by its name in FEATURES, through `plug`, which imports it when a run first asks for it: a run
imports the features it uses and no other (the virtual cache's driver calls, Triton). What a
seam asks is written once, below, as a Protocol; docs/layout.md's table is FEATURES, and
tests/test_layout.py holds the two, the Protocols and the imports to each other.
"""

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

# The seams, by the name docs/layout.md's table gives them
ATTENTION = "attention backend"  # prefill and decode over a step's metadata
CACHE = "cache allocation"  # the pool's storage and how a step's K/V are written to it
BLOCKS = "block manager"  # who holds which block; the scheduler asks it, never probes it
SAMPLER = "sampler"  # logits -> tokens (engine/sampler.py's), and what else a step draws
TRANSFORM = "model transform"  # a function of the loaded model, applied once, in the loader
PROCESS_GROUP = "process group"  # the processes a split model runs over
DECODE = "decode step"  # what one decode step computes from the model and returns
LAUNCH = "step launch"  # how a prepared step reaches the GPU: its rows' order, a graph's replay
RUN = "run"  # a program over the engine's parts: arrivals, the largest batch, beam search


class AttentionBackend(Protocol):
    prefill_in_graphs: bool  # its prefill reads the prompts' bounds on the GPU: a graph records it
    def prefill(self, q, k, v, batch) -> torch.Tensor: ...
    def prefill_after_prefix(self, q, key_blocks, value_blocks, batch) -> torch.Tensor: ...
    def decode(self, q, key_blocks, value_blocks, batch) -> torch.Tensor: ...


class KVCache(Protocol):
    def attention(self, layer: int, q, k, v, batch) -> torch.Tensor: ...


class BlockManager(Protocol):
    def allocate(self, request) -> int: ...  # the tokens found cached already
    def num_blocks_to_allocate(self, request) -> int: ...
    def num_blocks_to_append(self, rows) -> int: ...
    def append_token(self, rows) -> None: ...
    def free(self, request) -> None: ...
    def slots(self, rows, positions): ...


class Sampler(Protocol):
    def __call__(self, logits, rows, positions) -> torch.Tensor: ...  # [B, vocab] -> [B]


class DecodeStep(Protocol):
    def decode(self, tokens, positions, rows, slots, max_cache_seqlen: int) -> torch.Tensor: ...


class StepLaunch(Protocol):
    def replays(self, rows) -> bool: ...  # whether this step runs as a recorded graph


PROTOCOLS = {ATTENTION: AttentionBackend, CACHE: KVCache, BLOCKS: BlockManager,
             SAMPLER: Sampler, DECODE: DecodeStep, LAUNCH: StepLaunch}  # a class answers its seam's


@dataclass(frozen=True)
class Feature:
    seam: str
    module: str
    plugs: tuple[str, ...]  # what the engine takes from it; the first answers the seam's Protocol


FEATURES = {
    "log-probabilities": Feature(DECODE, "features.logprobs.logprobs",
                                 ("LogprobDecoder", "Logprobs", "as_vllm_logprobs", "top_of")),
    "beam search": Feature(SAMPLER, "features.beam_search", ("BeamSampler", "search_and_report")),
    "Triton attention": Feature(ATTENTION, "features.triton_attention",
                                ("TritonAttention", "TritonDecode")),
    "cascade attention": Feature(ATTENTION, "features.cascade.attention",
                                 ("CascadeAttention", "cascade_for")),
    "FP8 K/V": Feature(CACHE, "features.fp8.cache", ("FP8KVCache", "FP8", "Float8Writes")),
    "virtual memory": Feature(CACHE, "features.virtual.kv_cache",
                              ("EngineVirtualKVCache", "allocate_kv_cache", "mapping_report",
                               "add_layout_arguments")),
    "sharing blocks": Feature(BLOCKS, "features.sharing.block_manager", ("SharingBlockManager",)),
    "pages mapped ahead": Feature(BLOCKS, "features.virtual.mapping_ahead",
                                  ("MappingAheadManager", "MappingFailed")),
    "FP8 weights": Feature(TRANSFORM, "features.fp8.weights", ("quantize_weights",)),
    "tensor parallelism": Feature(PROCESS_GROUP, "features.tensor_parallel",
                                  ("start", "SHARE", "group", "least_over_processes",
                                   "summed_over_processes", "report_line")),
    "decode graphs": Feature(LAUNCH, "features.cuda_graphs", ("GraphDecoder",)),
    "prefill graphs": Feature(LAUNCH, "features.prefill_graphs",
                              ("GraphPrefill", "BUCKETS", "supports_prefill_graphs")),
    "longest first": Feature(LAUNCH, "features.longest_first", ("longest_first",)),
    "arrivals": Feature(RUN, "features.arrivals", ("poisson_arrival_times", "latency_report")),
    "largest batch": Feature(RUN, "features.max_batch", ("find_max_batch",)),
}


def plug(feature: str, name: str | None = None):
    """`name` of `feature` (by default what plugs into its seam), imported now."""
    declared = FEATURES[feature]
    name = name or declared.plugs[0]
    if name not in declared.plugs:
        raise KeyError(f"{feature} plugs in {', '.join(declared.plugs)}, not {name}")
    return getattr(importlib.import_module(declared.module), name)
