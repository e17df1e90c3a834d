"""Paged batched Llama 3 decoding: requests share a pool of small KV blocks, claimed as they grow.

    python llama3_paged.py 49 --random-weights

The pool is sized once from the KV budget (on a GPU, the memory left after the weights and the
activations; on the CPU, --kv-budget-gb). The block manager gives each prompt the blocks it
fills, one more block whenever a request's last block is full, and takes every block back the
moment the request finishes. flash-attn's paged kernel finds each request's blocks through the
block table, so they need not be contiguous.
"""

from plumbing.cli import exit_quietly_on_ctrl_c

SCRIPT = "llama3_paged.py"
exit_quietly_on_ctrl_c(SCRIPT)  # first, so that Ctrl-C while torch loads ends in one line too

import math

from block_manager import BlockManager
from plumbing.cli import (OUT_OF_MEMORY, UserError, argument_parser, format_bytes,
                          one_paragraph_errors, positive_int)
from plumbing.report import report
from plumbing.setup import (FLASH_BLOCK_MULTIPLE, find_max_batch, generate, kv_budget_bytes,
                            kv_cache, load)


def add_pool_arguments(parser) -> None:
    parser.add_argument("--block-size", type=positive_int,
                        help=f"tokens per KV block (default: {FLASH_BLOCK_MULTIPLE} with "
                             f"flash-attn, which needs a multiple of that; 16, as vLLM, with "
                             f"--attn triton or torch)")
    parser.add_argument("--decode-kernel", choices=["flash", "triton"], default="flash",
                        help="with flash-attn: the kernel that reads the blocks in decode steps; "
                             "triton: features/triton_attention.py's, faster on the H200, most "
                             "at short contexts (README, Speed)")
    parser.add_argument("--num-blocks", type=positive_int,
                        help="blocks in the pool (default: as many as fit in the KV budget, "
                             "--kv-budget-gb)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt in full, even where its first blocks are in "
                             "the pool already (prefix caching is on with --system-prompt or "
                             "--system-prompt-file, where requests share their first blocks)")
    parser.add_argument("--cascade", choices=["auto", "on", "off"], default="auto",
                        help="with a system prompt: decode attention reads its shared blocks once "
                             "per step, not once per request (features/cascade.py); auto: where "
                             "the measured rule says it pays")
    parser.add_argument("--beam-width", type=positive_int, default=1, metavar="K",
                        help="beam search: K beams per prompt sharing blocks, scored by summed "
                             "log-probabilities (features/beam_search.py); with --no-sharing "
                             "each beam holds blocks of its own")
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
                        f"{format_bytes(block_bytes)}, more than the KV budget of "
                        f"{format_bytes(kv_budget_bytes(setup))}. Use a smaller --block-size or a "
                        f"larger --kv-budget-gb.", OUT_OF_MEMORY)
    max_blocks_per_request = math.ceil(args.max_seq_len / block_size)
    cache = kv_cache(setup, num_blocks, block_size)
    # The block table the kernel reads: [N, max_blocks_per_request], row r = request r's blocks
    # (with --samples K, each sample is a request).
    # Blocks are shared where requests begin with the same tokens: samples of one prompt, or
    # prompts after one system prompt (the prefix cache). Elsewhere the prefix cache would find
    # next to nothing (1% of W2's prompt tokens), and the plain block manager runs.
    prefix_caching = setup.system_prompt is not None and not args.no_prefix_cache
    if args.no_sharing or not (args.samples > 1 or args.beam_width > 1 or prefix_caching):
        return cache, BlockManager(num_blocks, block_size, setup.num_sequences,
                                   max_blocks_per_request, setup.device)
    from features.sharing import SharingBlockManager
    return cache, SharingBlockManager(cache, setup.num_sequences, max_blocks_per_request,
                                      prefix_caching)


def main(argv=None) -> None:
    with one_paragraph_errors(SCRIPT):
        parser = argument_parser(SCRIPT, __doc__)
        add_pool_arguments(parser)
        setup = load(parser.parse_args(argv))  # the model and the first N prompts
        if setup.args.beam_width > 1:  # loaded only when asked for
            from plumbing import beams
            beams.check_arguments(setup.args)
            return beams.run_beam_search(setup, *allocate_kv_cache(setup))
        if setup.args.find_max_batch: return find_max_batch(setup, allocate_kv_cache)
        cache, manager = allocate_kv_cache(setup)  # where the three scripts differ
        report(setup, cache, manager, generate(setup, cache, manager))


if __name__ == "__main__":
    main()
