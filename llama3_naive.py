"""Naive batched Llama 3 decoding: every request reserves KV memory for max_seq_len tokens up front.

    python llama3_naive.py 7 --random-weights

This is the paged layout with one block per request, max_seq_len tokens long: the block table has
a single column and request r's row is [r]. A request that stops after 300 tokens still holds all
8,192 of its slots, which is why this script runs out of memory at a small batch.
"""

import torch

import cli
from attention import FLASH_BLOCK_MULTIPLE
from block_manager import BlockManager
from errors import OUT_OF_MEMORY, UserError
from kv_cache import KVCache
from report import GB


def reserve_kv_cache(setup):
    n, max_seq_len = setup.args.num_requests, setup.args.max_seq_len
    if setup.attention.name == "flash" and max_seq_len % FLASH_BLOCK_MULTIPLE:
        raise UserError(f"--max-seq-len {max_seq_len}: flash-attn reads each request's cache as one "
                        f"block, and its blocks must be a multiple of {FLASH_BLOCK_MULTIPLE} tokens. "
                        f"Use a multiple of {FLASH_BLOCK_MULTIPLE}, or --attn torch.")
    try:  # [n_layers, n * max_seq_len, n_kv_heads, head_dim] for K and for V, before any token
        cache = KVCache(setup.model.args, num_blocks=n, block_size=max_seq_len, dtype=setup.dtype,
                        device=setup.device, attention=setup.attention)
    except torch.OutOfMemoryError as e:
        per_token = setup.model.args.kv_bytes_per_token(setup.dtype)
        free = torch.cuda.mem_get_info(setup.device)[0]
        raise UserError(
            f"Out of GPU memory reserving the naive KV caches: {n} requests x {max_seq_len:,} "
            f"tokens x {per_token // 1024} KiB per token = {n * max_seq_len * per_token / GB:.1f} GB "
            f"needed, {free / GB:.1f} GB free after the weights. Try fewer requests or a smaller "
            f"--max-seq-len, or llama3_paged.py, which reserves only the blocks requests fill.",
            OUT_OF_MEMORY) from e
    manager = BlockManager(num_blocks=n, block_size=max_seq_len, max_requests=n,
                           max_blocks_per_request=1, device=setup.device)
    return cache, manager


if __name__ == "__main__":
    cli.main("llama3_naive.py", __doc__.splitlines()[0], reserve_kv_cache)
