"""Paged batched Llama 3 decoding: requests share a pool of small KV blocks, claimed as they grow.

    python llama3_paged.py 49 --random-weights

The pool is sized once from the KV budget (on a GPU, the memory left after the weights and the
activations; on the CPU, --kv-budget-gb). The block
manager gives each prompt the blocks it fills, one more block whenever a request's last block is
full, and takes every block back the moment the request finishes. flash-attn's paged kernel finds
each request's blocks through the block table, so they need not be contiguous.
"""

from engine.errors import exit_quietly_on_ctrl_c

SCRIPT = "llama3_paged.py"
exit_quietly_on_ctrl_c(SCRIPT)  # first, so that Ctrl-C while torch loads ends in one line too

import math

from block_manager import BlockManager
from engine.attention import FLASH_BLOCK_MULTIPLE
from engine.errors import OUT_OF_MEMORY, UserError
from engine.generate import generate
from engine.kv_cache import KVCache
from engine.max_batch import find_max_batch
from engine.report import GB, report
from engine.setup import (argument_parser, kv_budget_bytes, load, one_paragraph_errors,
                          positive_int)


def add_pool_arguments(parser) -> None:
    parser.add_argument("--block-size", type=positive_int,
                        help=f"tokens per KV block (default: {FLASH_BLOCK_MULTIPLE} with "
                             f"flash-attn, which needs a multiple of that; 16, as vLLM, with "
                             f"--attn triton or torch)")
    parser.add_argument("--num-blocks", type=positive_int,
                        help="blocks in the pool (default: as many as fit in the KV budget, "
                             "--kv-budget-gb)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt in full, even where its first blocks are in "
                             "the pool already (prefix caching is on by default)")
    parser.add_argument("--no-sharing", action="store_true",
                        help="every sequence holds blocks of its own: no prefix caching, and "
                             "--samples prefill a copy of the prompt each (the comparison run)")


def allocate_kv_cache(setup):
    """Many small blocks, as many as memory holds, shared by all requests: each claims one more
    only when its last block is full, so at most block_size - 1 of its slots sit empty."""
    args = setup.args
    block_size = args.block_size or (FLASH_BLOCK_MULTIPLE if setup.attention.name == "flash" else 16)
    block_bytes = block_size * setup.kv_bytes_per_token
    num_blocks = args.num_blocks or int(kv_budget_bytes(setup) // block_bytes)
    if num_blocks == 0:
        raise UserError(f"Not one KV block fits: a block of {block_size:,} tokens takes "
                        f"{block_bytes / GB:,.3f} GB, more than the KV budget of "
                        f"{kv_budget_bytes(setup) / GB:,.3f} GB. Use a smaller --block-size or a "
                        f"larger --kv-budget-gb.", OUT_OF_MEMORY)
    max_blocks_per_request = math.ceil(args.max_seq_len / block_size)
    cache = KVCache(setup.model.args, num_blocks, block_size, setup.dtype, setup.device,
                    setup.attention)
    # The block table the kernel reads: [N x K, max_blocks_per_request], row r = request r's
    # blocks (with --samples K, each sample is a request). Blocks can appear in several rows:
    # samples of a prompt share it, and prompts share their cached prefix.
    manager = BlockManager(num_blocks, block_size, max_requests=setup.num_sequences,
                           max_blocks_per_request=max_blocks_per_request, device=setup.device,
                           share_samples=not args.no_sharing,
                           prefix_caching=not (args.no_sharing or args.no_prefix_cache))
    return cache, manager


def main(argv=None) -> None:
    with one_paragraph_errors(SCRIPT):
        parser = argument_parser(SCRIPT, __doc__)
        add_pool_arguments(parser)
        setup = load(parser.parse_args(argv))  # the model and the first N prompts
        if setup.args.find_max_batch: return find_max_batch(setup, allocate_kv_cache)
        cache, manager = allocate_kv_cache(setup)  # where the three scripts differ
        report(setup, cache, manager, generate(setup, cache, manager))


if __name__ == "__main__":
    main()
