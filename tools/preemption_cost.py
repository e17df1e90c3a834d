"""The PagedAttention paper's Figure 19, ours: what one preemption costs, swapped or recomputed,
for blocks of 16 to 256 tokens.

    python tools/preemption_cost.py                      # 8 requests of 1,024 tokens, random 8B
    python tools/preemption_cost.py --requests 1 --tokens 4096 --json cost.json

Requests are grown token by token, as decoding grows them, so that their blocks interleave in
the pool, and the pool holds random K/V. Then, per block size, the time to preempt all of them
and have them back, each way, as --continuous does it:

- swap (engine/swap.py): copy every victim's blocks to host memory, free them, take new
  blocks, copy the K/V back. Each way, the copies of all victims are made at once: one gather
  of K and one of V on the GPU, and one transfer per run of consecutive host blocks.
- recompute (engine/scheduler.py): free the blocks, take new ones, and prefill every token
  again. A prefill with nothing cached runs the contiguous attention kernel over the packed
  tokens, so the block size enters only where each token's K/V is written.

The paper measures swap costing more with small blocks (many small transfers) and recompute not
depending on the block size. Beside each figure, its floor on this GPU: the K/V bytes moved
twice at the pinned host-device bandwidth measured here, and the prefill's projections (2
FLOPs per layer weight per token, the output head's for each request's last; attention's left
out) at the matmul rate measured here. GPU times are medians of CUDA-event timings after a warm-up.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

PROG = "preemption_cost.py"  # its name in messages, however it is started

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c(PROG)  # before torch loads

from plumbing.cli import MODELS, UserError

import numpy as np
import torch

from block_manager import BlockManager
from engine.scheduler import Step
from engine.model_runner import ModelRunner
from engine.kv_cache import EngineKVCache
from engine.request import EngineRequest
from engine.swap import HostBlocks
from plumbing.inputs import random_model
from llama3_paged import Llama
from plumbing.cli import (OUT_OF_MEMORY, HelpFormatter, device, first_paragraph, format_bytes,
                          host_available_bytes, one_paragraph_errors, positive_int, writable_file)
from tools.arguments import positive_int_list
from engine.report import format_seconds
from plumbing.inputs import DTYPES, PRESETS
from engine.loader import choose_attention
from tools.shared import matmul_flops_per_second, median_cuda_seconds, write_and_print

BLOCK_SIZES = [16, 32, 64, 128, 256]


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--requests", type=positive_int, default=8, help="requests preempted at once")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens each has cached")
    p.add_argument("--block-sizes", type=positive_int_list, default=BLOCK_SIZES,
                   help="comma-separated tokens per block")
    p.add_argument("--repeats", type=positive_int, default=10, help="timings per figure (median)")
    p.add_argument("--model", choices=MODELS, default="8b",
                   help="random weights of these shapes")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda:N, or cpu (with --model tiny)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--attn", choices=["auto", "flash", "triton", "torch"], default="auto",
                   help="the recomputing prefill's kernel")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    return p.parse_args(argv)


class Timer:
    """Seconds of a piece of work: CUDA events on a GPU (the copies and kernels themselves), the
    wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, work) -> float:
        if not self.cuda:
            start = time.perf_counter()
            work()
            return time.perf_counter() - start
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1000


def grown_requests(manager, num_requests: int, tokens: int) -> list[SimpleNamespace]:
    """num_requests requests of `tokens` tokens, grown one token a step each, as a decode batch
    grows: request r's blocks are every num_requests-th block the pool hands out. Whatever the
    pool held before is freed first."""
    requests = [SimpleNamespace(row=r, tokens=[1]) for r in range(num_requests)]
    for request in requests:
        if request.row in manager.owned_blocks:
            manager.free(request)
    for request in requests:
        manager.allocate(request)
    rows = np.arange(num_requests)
    for _ in range(tokens - 1):
        manager.append_token(rows)
    return requests


def swap_seconds(host, manager, requests, tokens: int, timer) -> float:
    """Preempt every request by swapping and bring it back, as engine/scheduler.py does."""

    def preempt_and_return():
        kept = {r.row: host.copy_out(manager.owned_blocks[r.row]) for r in requests}
        host.flush()  # one step's preemptions
        for request in requests:
            manager.free(request)
        for request in requests:
            manager.allocate(SimpleNamespace(row=request.row, tokens=[1] * tokens))
            host.copy_in(kept[request.row], manager.owned_blocks[request.row])
        host.flush()  # a later step's returns
    return timer(preempt_and_return)


def recompute_seconds(engine, manager, requests, tokens: int, timer) -> float:
    """Preempt every request by freeing its blocks, then prefill all its tokens again."""
    generator = np.random.default_rng(0)
    again = [EngineRequest(r.row, generator.integers(0, 1000, tokens).tolist(), 1) for r in requests]

    def preempt_and_recompute():
        for request in requests:
            manager.free(request)
        for request in again:
            manager.allocate(request)
        rows = np.array([r.row for r in again])
        engine.prefill(Step("prefill", again, rows, num_cached=np.zeros(len(again), dtype=np.int64)))
    return timer(preempt_and_recompute)


def host_copy_bandwidth(device) -> float:
    """Bytes per second between pinned host memory and the GPU, the mean of both ways."""
    host = torch.empty(2**28, dtype=torch.bfloat16, pin_memory=True)  # 512 MiB
    gpu = torch.randn(2**28, dtype=torch.bfloat16, device=device)
    seconds = [median_cuda_seconds(copy, repeats=5)
               for copy in (lambda: host.copy_(gpu), lambda: gpu.copy_(host))]
    return host.nbytes / statistics.mean(seconds)


def measure_block_size(model, attention, block_size: int, a, timer) -> dict:
    """Both ways of preempting, through a pool of blocks of block_size."""
    blocks_per_request = -(-a.tokens // block_size)
    num_blocks = 2 * a.requests * blocks_per_request  # room to take new blocks while holding
    dtype, device = model.tok_embeddings.weight.dtype, model.tok_embeddings.weight.device
    cache = EngineKVCache(model.args, num_blocks, block_size, dtype, device, attention)
    cache.k.normal_(), cache.v.normal_()  # K/V as a run holds them, never zeros
    manager = BlockManager(num_blocks, block_size, a.requests, blocks_per_request, device)
    engine = ModelRunner(model, cache, manager)
    host = HostBlocks(cache, num_blocks=a.requests * blocks_per_request)
    figures = {}
    grown = lambda: grown_requests(manager, a.requests, a.tokens)  # again before each timing
    for name, fn in (("swap", lambda: swap_seconds(host, manager, grown(), a.tokens, timer)),
                     ("recompute", lambda: recompute_seconds(engine, manager, grown(), a.tokens,
                                                             timer))):
        fn()  # warm-up: kernels chosen, pinned memory touched
        figures[name] = statistics.median(fn() for _ in range(a.repeats))
    return {"block_size": block_size, "blocks_per_request": blocks_per_request,
            "swap_seconds": figures["swap"], "recompute_seconds": figures["recompute"]}


def check_the_kv_fits(a, device, dtype) -> None:
    """The K/V this tool allocates, refused before the model loads if the device lacks it: a pool
    twice the preempted requests' K/V for the largest block size (room to grow while holding) and
    their copy in pinned host memory, which swapping needs."""
    per_token = PRESETS[a.model].kv_bytes_per_token(dtype)
    largest_block = max(a.block_sizes)
    tokens = a.requests * -(-a.tokens // largest_block) * largest_block
    pool, host = 2 * tokens * per_token, tokens * per_token
    on_device = pool + (host if device.type == "cpu" else 0)
    free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
            else host_available_bytes())
    if on_device > free or host > host_available_bytes():
        raise UserError(f"Out of memory: {a.requests:,} requests x {a.tokens:,} tokens of "
                        f"{per_token // 1024} KiB of K/V each need a pool of {format_bytes(pool)} "
                        f"on {device} and {format_bytes(host)} of host memory to swap to, and "
                        f"{device} has {format_bytes(free)} free. Use fewer --requests or "
                        f"--tokens, or a smaller --model.", OUT_OF_MEMORY)


def measure(a) -> dict:
    device = a.device
    dtype = DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    check_the_kv_fits(a, device, dtype)
    model = random_model(Llama, a.model, device, dtype, a.tokens + 1)
    attention = choose_attention(a.attn, device)
    timer = Timer(device)
    kv_bytes = a.requests * a.tokens * model.args.kv_bytes_per_token(dtype)
    rows = [measure_block_size(model, attention, block_size, a, timer) for block_size in a.block_sizes]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "model": f"{a.model}, random weights", "dtype": str(dtype).removeprefix("torch."),
              "attention": attention.name, "requests": a.requests, "tokens": a.tokens,
              "kv_bytes": kv_bytes, "rows": rows}
    if device.type == "cuda":
        result["host_copy_bytes_per_second"] = host_copy_bandwidth(device)
        # Every layer's weights for every token; the output head for each request's last token.
        per_token = sum(p.numel() for p in model.layers.parameters())
        flops = 2 * (per_token * a.tokens + model.output.weight.numel()) * a.requests
        result["recompute_floor_seconds"] = flops / matmul_flops_per_second(device, dtype)
    return result


def print_table(r: dict) -> None:
    print(f"\nOne preemption of {r['requests']} requests x {r['tokens']:,} tokens "
          f"({format_bytes(r['kv_bytes'])} of K/V); {r['device']}, {r['model']}, {r['dtype']}, "
          f"recompute's prefill with --attn {r['attention']}")
    floor = r.get("host_copy_bytes_per_second")
    if floor:
        print(f"  pinned host-device copies: {floor / 1e9:.1f} GB/s; swapping moves the K/V out "
              f"and back: {format_seconds(2 * r['kv_bytes'] / floor)} at that rate; recomputing "
              f"their projections at the matmul rate measured here: "
              f"{format_seconds(r['recompute_floor_seconds'])}")
    print(f"  {'block':>6} {'blocks/request':>15} {'swap':>10} {'recompute':>10}  swap/recompute")
    for row in r["rows"]:
        print(f"  {row['block_size']:>6} {row['blocks_per_request']:>15,} "
              f"{format_seconds(row['swap_seconds']):>10} {format_seconds(row['recompute_seconds']):>10}"
              f"  {row['swap_seconds'] / row['recompute_seconds']:.2f}x")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors(PROG):
        write_and_print(measure(a), a.json, print_table)


if __name__ == "__main__":
    main()
