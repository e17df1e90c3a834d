"""Naive batched Llama 3 decoding: every request reserves KV memory for max_seq_len tokens up front.

    python llama3_naive.py 7 --random-weights

Read it after llama3_paged.py: the model, the loop and the report are the lesson's, imported.
Only the cache differs. It is the paged pool with one block per request, max_seq_len tokens
long: the block table has a single column and request r's row is [r]. A request that stops
after 300 tokens still holds all 8,192 of its slots, which is why this script runs out of memory
at a small batch.
"""

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c("llama3_naive.py")

import sys

import llama3_paged as lesson
from block_manager import BlockManager
from plumbing.cli import (OUT_OF_MEMORY, UserError, format_bytes, hand_to_the_engine,
                          needs_features)
from plumbing.inputs import checked_kv_allocation, kv_budget_bytes


def requests_that_fit(run, budget_bytes: float) -> int:
    """How many max_seq_len rows the KV budget holds."""
    return int(budget_bytes // (run.args.max_seq_len * run.kv_bytes_per_token))


def check_rows_fit(run, num_rows: int, budget_bytes: float) -> None:
    block_size, fits = run.args.max_seq_len, requests_that_fit(run, budget_bytes)
    if not 0 < num_rows <= fits:
        asked = max(num_rows, 1)
        raise UserError(
            f"Out of memory: {asked:,} requests x {block_size:,} tokens x "
            f"{run.kv_bytes_per_token // 1024} KiB per token = "
            f"{format_bytes(asked * block_size * run.kv_bytes_per_token)} of KV cache to reserve "
            f"up front, and the KV budget is {format_bytes(budget_bytes)}: {fits:,} requests fit. "
            f"Try fewer requests or a smaller --max-seq-len, or llama3_paged.py, which reserves "
            f"only the blocks requests fill.", OUT_OF_MEMORY)


def allocate_kv_cache(run):
    """One block of max_seq_len tokens per request, its worst case, reserved before its first
    token whether or not it will ever use it. The block table the kernel reads is [N, 1], one
    column: request r's row is its one block."""
    num_rows, block_size = run.num_sequences, run.args.max_seq_len
    check_rows_fit(run, num_rows, kv_budget_bytes(run))
    with checked_kv_allocation(run, num_rows, block_size):
        cache = lesson.KVCache(run.model.args, num_rows, block_size, run.dtype, run.device,
                               run.attention)
    return cache, BlockManager(num_rows, block_size, run.num_sequences, 1, run.device)


def no_pool_arguments(parser) -> None:
    """The naive cache has nothing to size: its one block per request is --max-seq-len long."""


def main(argv=None) -> None:
    lesson.main(argv, "llama3_naive.py", __doc__, no_pool_arguments, allocate_kv_cache)


if __name__ == "__main__":  # a feature's flag: the engine's program (python -m engine.run)
    if needs_features("llama3_naive.py", sys.argv[1:]):
        hand_to_the_engine("llama3_naive.py", sys.argv[1:])
    else:
        main()
