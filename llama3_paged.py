"""Paged batched Llama 3 decoding: requests share a pool of small KV blocks, claimed as they grow.

    python llama3_paged.py 49 --random-weights

The pool is sized once from the GPU memory left after the weights and the activations. The block
manager gives each prompt the blocks it fills, one more block whenever a request's last block is
full, and takes every block back the moment the request finishes. flash-attn's paged kernel finds
each request's blocks through the block table, so they need not be contiguous.
"""

import math

import torch

import cli
from attention import FLASH_BLOCK_MULTIPLE
from errors import OUT_OF_MEMORY, UserError
from generate import PREFILL_CHUNK_TOKENS
from kv_cache import KVCache, PrefillBatch
from report import GB


def add_pool_arguments(parser) -> None:
    parser.add_argument("--block-size", type=cli.positive_int,
                        help=f"tokens per KV block (default: {FLASH_BLOCK_MULTIPLE} with "
                             f"flash-attn, which needs a multiple of that; 16, as vLLM, with "
                             f"--attn triton or torch)")
    parser.add_argument("--num-blocks", type=cli.positive_int,
                        help="blocks in the pool (default: as many as fit in "
                             "--gpu-memory-utilization; on the CPU, enough for every request to "
                             "reach --max-seq-len)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU's memory for weights, activations and KV pool")


def activation_peak_bytes(setup) -> int:
    """Measured, not guessed: run one full prefill chunk on a throwaway cache and read the peak.
    Decode needs less, apart from the logits of the whole batch, which are added."""
    model, seq_len = setup.model, min(PREFILL_CHUNK_TOKENS, setup.args.max_seq_len)
    total = (PREFILL_CHUNK_TOKENS // seq_len) * seq_len
    scratch = KVCache(model.args, num_blocks=1, block_size=total, dtype=setup.dtype,
                      device=setup.device, attention=setup.attention)
    bounds = list(range(0, total + 1, seq_len))
    batch = PrefillBatch(slot_mapping=torch.arange(total, device=setup.device),
                         cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=setup.device),
                         cu_seqlens_host=bounds, max_seqlen=seq_len)
    tokens = torch.randint(model.args.vocab_size, (total,), device=setup.device)
    positions = torch.arange(total, device=setup.device) % seq_len
    torch.cuda.synchronize(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    with torch.inference_mode():
        model(tokens, positions, scratch, batch,
              logits_at=torch.tensor(bounds[1:], device=setup.device) - 1)
    prefill_peak = torch.cuda.max_memory_allocated(setup.device) - before
    decode_logits = setup.args.num_requests * model.args.vocab_size * (setup.dtype.itemsize + 4)
    return max(prefill_peak, decode_logits)


def blocks_that_fit(setup, block_size: int) -> int:
    args = setup.args
    max_blocks_per_request = math.ceil(args.max_seq_len / block_size)
    if setup.device.type != "cuda":  # no fixed memory to fill: room for every request's maximum
        return args.num_requests * max_blocks_per_request
    total = torch.cuda.get_device_properties(setup.device).total_memory
    budget = (total * args.gpu_memory_utilization - torch.cuda.memory_allocated(setup.device)
              - activation_peak_bytes(setup))
    block_bytes = block_size * setup.model.args.kv_bytes_per_token(setup.dtype)
    if budget < block_bytes:
        raise UserError(f"No GPU memory left for KV blocks: {total * args.gpu_memory_utilization / GB:.1f} GB "
                        f"allowed, {torch.cuda.memory_allocated(setup.device) / GB:.1f} GB taken by "
                        f"the weights. Raise --gpu-memory-utilization or use a smaller --model.",
                        OUT_OF_MEMORY)
    return int(budget // block_bytes)


def reserve_kv_cache(setup):
    # Many small blocks, as many as memory allows; requests claim them one at a time as they grow.
    args = setup.args
    block_size = args.block_size or (FLASH_BLOCK_MULTIPLE if setup.attention.name == "flash" else 16)
    return cli.allocate_kv_cache(
        setup, num_blocks=args.num_blocks or blocks_that_fit(setup, block_size),
        block_size=block_size, block_size_flag="--block-size",
        advice="Use a smaller --num-blocks or --gpu-memory-utilization.")


if __name__ == "__main__":
    cli.main("llama3_paged.py", __doc__.splitlines()[0], reserve_kv_cache, add_pool_arguments)
