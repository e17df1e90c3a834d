"""Naive batched Llama 3 decoding: every request reserves KV memory for max_seq_len tokens up front.

    python llama3_naive.py 7 --random-weights

This is the paged layout with one block per request, max_seq_len tokens long: the block table has
a single column and request r's row is [r]. A request that stops after 300 tokens still holds all
8,192 of its slots, which is why this script runs out of memory at a small batch.
"""

import cli


def reserve_kv_cache(setup):
    # N blocks of max_seq_len tokens: every request's worst case, reserved before its first token.
    return cli.allocate_kv_cache(
        setup, num_blocks=setup.args.num_requests, block_size=setup.args.max_seq_len,
        block_size_flag="--max-seq-len",
        advice="Try fewer requests or a smaller --max-seq-len, or llama3_paged.py, which "
               "reserves only the blocks requests fill.")


if __name__ == "__main__":
    cli.main("llama3_naive.py", __doc__.splitlines()[0], reserve_kv_cache)
