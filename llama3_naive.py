"""Naive batched Llama 3 decoding: every request reserves KV memory for max_seq_len tokens up front.

    python llama3_naive.py 7 --random-weights

This is the paged layout with one block per request, max_seq_len tokens long: the block table has
a single column and request r's row is [r]. A request that stops after 300 tokens still holds all
8,192 of its slots, which is why this script runs out of memory at a small batch.
"""

from plumbing.cli import exit_quietly_on_ctrl_c

SCRIPT = "llama3_naive.py"
exit_quietly_on_ctrl_c(SCRIPT)  # first, so that Ctrl-C while torch loads ends in one line too

from block_manager import BlockManager
from plumbing.cli import (OUT_OF_MEMORY, UserError, argument_parser, format_bytes,
                          one_paragraph_errors)
from plumbing.report import report
from plumbing.setup import find_max_batch, generate, kv_budget_bytes, kv_cache, load


def allocate_kv_cache(setup):
    """One block of max_seq_len tokens per request: every request's worst case, reserved before
    its first token, whether or not it will ever use it. A static batch needs N of them; with
    --continuous there are as many as the budget holds, and a request waits for a free one."""
    args = setup.args
    block_size, cache_bytes = args.max_seq_len, args.max_seq_len * setup.kv_bytes_per_token
    budget = kv_budget_bytes(setup)
    fits = int(budget // cache_bytes)
    num_blocks = min(fits, setup.num_sequences) if args.continuous else setup.num_sequences
    if not 0 < num_blocks <= fits:
        asked = max(num_blocks, 1)
        raise UserError(
            f"Out of memory: {asked:,} requests x {block_size:,} tokens x "
            f"{setup.kv_bytes_per_token // 1024} KiB per token = "
            f"{format_bytes(asked * cache_bytes)} "
            f"of KV cache to reserve up front, and the KV budget is {format_bytes(budget)}: "
            f"{fits:,} requests fit. Try fewer requests or a smaller --max-seq-len, or "
            f"llama3_paged.py, which reserves only the blocks requests fill.", OUT_OF_MEMORY)
    cache = kv_cache(setup, num_blocks, block_size)
    # The block table the kernel reads: [N, 1], one column: request r's row is its one block.
    return cache, BlockManager(num_blocks, block_size, setup.num_sequences, 1, setup.device)


def main(argv=None) -> None:
    with one_paragraph_errors(SCRIPT):
        setup = load(argument_parser(SCRIPT, __doc__).parse_args(argv))  # the model, the first N prompts
        if setup.args.find_max_batch: return find_max_batch(setup, allocate_kv_cache)
        cache, manager = allocate_kv_cache(setup)  # where the three scripts differ
        report(setup, cache, manager, generate(setup, cache, manager))


if __name__ == "__main__":
    main()
