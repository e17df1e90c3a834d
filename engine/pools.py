"""The KV pools of the scripts' runs with features: how much memory they get, and the pool and
block manager each script's flags ask for.
"""

import math

import torch

import llama3_naive
import llama3_paged as lesson
from engine.kv_cache import EngineKVCache
from engine.seams import plug
from engine.sampler import GREEDY_BELOW, ROWS_AT_ONCE, make_sampler
from plumbing import inputs
from plumbing.cli import torchrun_process
from plumbing.inputs import Run


def kv_budget_bytes(run: Run) -> float:
    budget = inputs.kv_budget_bytes(run, sampling_peak_bytes(run))
    if torchrun_process() is not None:  # every process sizes the same pool
        budget = plug("tensor parallelism", "least_over_processes")(budget)
    return budget


def sampling_peak_bytes(run) -> int:
    """Sampling's own memory (softmax, sort, sums), measured on one batch of rows."""
    if run.args.temperature < GREEDY_BELOW or run.device.type != "cuda":
        return 0  # greedy: an argmax; on the CPU the KV budget is a fixed share (no peak to read)
    sampler = make_sampler(run.args)
    rows = min(run.num_sequences, ROWS_AT_ONCE)
    logits = torch.zeros(rows, run.model.args.vocab_size, dtype=run.dtype, device=run.device)
    ids = torch.arange(rows, device=run.device)
    torch.cuda.reset_peak_memory_stats(run.device)
    before = torch.cuda.memory_allocated(run.device)
    sampler(logits, ids, ids)
    return torch.cuda.max_memory_allocated(run.device) - before


def kv_cache(run: Run, num_blocks: int, block_size: int) -> lesson.KVCache:
    """The engine's pool (engine/kv_cache.py); with CUDA graphs, one spare slot more, for the
    graphs' padding rows."""
    with inputs.checked_kv_allocation(run, num_blocks, block_size):
        if run.kv_cache_dtype is not None:
            return plug("FP8 K/V")(run.model.args, num_blocks, block_size, run.dtype, run.device,
                              run.attention, split_heads=run.split)
        return EngineKVCache(run.model.args, num_blocks, block_size, run.dtype, run.device,
                             run.attention, spare_slot=decodes_with_graphs(run))


def decodes_with_graphs(run: Run) -> bool:
    """CUDA graphs where they can run: on CUDA, with an attention that reads its lengths on the
    GPU, unless --eager."""
    return run.device.type == "cuda" and not run.args.eager and run.attention.name != "torch"


def shares_blocks(run: Run, served: bool = False) -> bool:
    """Whether the run's pool shares blocks where requests begin with the same tokens (paged,
    unless --no-sharing): samples of one prompt (--samples; `served`: a served request may ask
    for n), beams, or prompts after one system prompt (the prefix cache). Elsewhere the prefix
    cache would find next to nothing (1% of W2's prompt tokens), and the lesson's block manager
    runs. The engine asks this of the flags, not of the manager's class."""
    args = run.args
    return (args.cache == "paged" and not args.no_sharing
            and (served or args.samples > 1 or args.beam_width > 1 or caches_prefix(run)))


def caches_prefix(run: Run) -> bool:
    """Whether later prompts find a system prompt's blocks in the pool
    (features/sharing/prefix_cache.py)."""
    args = run.args
    return (args.cache == "paged" and not args.no_sharing
            and run.system_prompt is not None and not args.no_prefix_cache)


def allocate_paged(run: Run, samples: bool = False):
    """llama3_paged.py's pool, its blocks shared where `shares_blocks` says (`samples`: a
    server's requests may ask for n)."""
    args = run.args
    num_blocks, block_size = lesson.pool_size(run, kv_budget_bytes(run))
    cache, max_blocks = kv_cache(run, num_blocks, block_size), math.ceil(args.max_seq_len / block_size)
    if not shares_blocks(run, served=samples):
        return cache, lesson.BlockManager(num_blocks, block_size, run.num_sequences, max_blocks,
                                          run.device)
    return cache, plug("sharing blocks")(cache, run.num_sequences, max_blocks, caches_prefix(run))


def allocate_naive(run: Run):
    """llama3_naive.py's rows: N for a static batch; with --continuous as many as the budget
    holds, and a request waits for a free one."""
    budget, rows = kv_budget_bytes(run), run.num_sequences
    if run.args.continuous:
        rows = min(llama3_naive.requests_that_fit(run, budget), rows)
    llama3_naive.check_rows_fit(run, rows, budget)
    return kv_cache(run, rows, run.args.max_seq_len), lesson.BlockManager(
        rows, run.args.max_seq_len, run.num_sequences, 1, run.device)