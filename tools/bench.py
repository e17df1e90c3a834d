"""How close the scripts come to the GPU's limits, on a fixed workload.

    python tools/bench.py paged                  # workload W through llama3_paged.py's cache
    python tools/bench.py naive                  # the same W through llama3_naive.py's cache
    python tools/bench.py paged --attn torch     # W with the PyTorch reference attention

Workload W: the first 256 prompts of sharegpt_filtered.json, chat-formatted; exactly 256 new
tokens each, greedy, end-of-text ignored; random 8b weights in bf16; --max-seq-len 1536 (so the
naive caches fit); flash-attn. Every flag changes one part of it.

A decode step must read every weight once and the K/V of every token cached so far; no step can
be faster than those bytes over the memory bandwidth. Each step is set against that bound, with
the bandwidth measured here, on this GPU, by a device-to-device copy. Prefill does ~15 GFLOP per
token and is set against a bf16 matmul rate measured the same way. GPU work is timed with CUDA
events after a warm-up; figures are medians.

Also a CPU micro-benchmark of the block manager's bookkeeping per decode step with 1,000 live
requests: the host work a step needs before the GPU can start it.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from engine.errors import UserError, exit_quietly_on_ctrl_c, writable_file

exit_quietly_on_ctrl_c("bench.py")  # before torch loads

import numpy as np
import torch

import llama3_naive
import llama3_paged
from block_manager import BlockManager
from engine.generate import EagerDecoder, append_slots, generate_tokens, make_decoder
from engine.kv_cache import DecodeBatch
from engine.report import GB
from engine.setup import (DTYPES, argument_parser, load, one_paragraph_errors, positive_int,
                          sequence_length)

SCRIPTS = {"naive": llama3_naive, "paged": llama3_paged}


def median_cuda_seconds(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes per second a device-to-device copy moves, counting the read and the write."""
    source = torch.randn(2**29, dtype=torch.bfloat16, device=device)  # 1 GiB
    target = torch.empty_like(source)
    return 2 * source.nbytes / median_cuda_seconds(lambda: target.copy_(source))


def matmul_flops_per_second(device, dtype, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / median_cuda_seconds(lambda: a @ b)


def prefill_flops(args, prompt_lens: list[int]) -> float:
    """Matmul FLOPs of a prefill: projections on every token, the output head on each prompt's
    last token, and causal attention (QK^T and PV over the tokens before each query)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer_params = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.ffn_dim
    tokens = sum(prompt_lens)
    attention = sum(2 * args.n_heads * args.head_dim * n * (n + 1) for n in prompt_lens)
    return (2 * per_layer_params * tokens * args.n_layers + attention * args.n_layers
            + 2 * args.dim * args.vocab_size * len(prompt_lens))


def weight_bytes_read_per_step(model) -> int:
    """Every weight, except that the embedding table gives only the batch's rows (unless it is
    also the output head)."""
    total = sum(p.nbytes for p in model.parameters())  # tied weights counted once
    return total if model.args.tie_embeddings else total - model.tok_embeddings.weight.nbytes


def bookkeeping_seconds_per_step(block_size: int, live: int = 1000, steps: int = 500) -> float:
    """Median host time of the block manager's part of a decode step: `append_slots`, as
    generate calls it, then freeing and re-admitting the requests that finish (so `live` stay
    live). On the CPU, as the scripts do it between two GPU steps."""
    rng = np.random.default_rng(0)
    max_seq_len = 4096
    manager = BlockManager(num_blocks=live * max_seq_len // block_size, block_size=block_size,
                           max_requests=live, max_blocks_per_request=max_seq_len // block_size)
    remaining = rng.integers(1, 1000, live)
    for r in range(live):
        manager.allocate(r, int(rng.integers(1, 1000)))
    requests, times = np.arange(live), []
    for step in range(steps):
        start = time.perf_counter()
        append_slots(manager, requests, step)
        remaining -= 1
        for r in np.flatnonzero(remaining == 0).tolist():
            manager.free(r)
            manager.allocate(r, int(rng.integers(1, 1000)))
            remaining[r] = rng.integers(1, 1000)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_seconds_per_layer(setup, cache, lengths: list[int]) -> float:
    """One layer's decode attention alone, for requests cached to `lengths`, over the pool's
    current contents: the kernel that --attn chooses, without the rest of the step."""
    block_size, device = cache.block_size, setup.device
    manager = BlockManager(cache.num_blocks, block_size, len(lengths),
                           -(-max(lengths) // block_size), device)
    for r, n in enumerate(lengths):
        manager.allocate(r, n)
    args = setup.model.args
    q = torch.randn(len(lengths), args.n_heads, args.head_dim, dtype=setup.dtype, device=device)
    batch = DecodeBatch(None, manager.block_table, torch.tensor(lengths, dtype=torch.int32,
                                                                device=device), max(lengths))
    key_blocks = cache.k[0, :cache.spare_slot].view(cache.block_shape)
    value_blocks = cache.v[0, :cache.spare_slot].view(cache.block_shape)
    return median_cuda_seconds(lambda: setup.attention.decode(q, key_blocks, value_blocks, batch))


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("script", choices=SCRIPTS, help="whose KV cache: llama3_naive.py's or llama3_paged.py's")
    p.add_argument("--num-requests", type=positive_int, default=256)
    p.add_argument("--new-tokens", type=positive_int, default=256,
                   help="tokens generated per request")
    p.add_argument("--sharegpt-replies", action="store_true",
                   help="generate each request's ShareGPT reply length (at most --new-tokens), as "
                        "the scripts do with --random-weights, instead of exactly --new-tokens")
    p.add_argument("--max-seq-len", type=sequence_length, default=1536)
    p.add_argument("--block-size", type=positive_int, default=256, help="paged only")
    p.add_argument("--attn", choices=["flash", "triton", "torch"], default="flash")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--model", choices=["8b", "1b", "tiny"], default="8b")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    return p.parse_args(argv)


def script_arguments(bench_args):
    """The same run as the script's command line would set it up."""
    a = bench_args
    argv = [str(a.num_requests), "--random-weights", "--model", a.model, "--dtype", a.dtype,
            "--attn", a.attn, "--max-seq-len", str(a.max_seq_len),
            "--max-new-tokens", str(a.new_tokens)] + (["--eager"] if a.eager else [])
    p = argument_parser(f"llama3_{a.script}.py", __doc__)
    if a.script == "paged":
        llama3_paged.add_pool_arguments(p)
        argv += ["--block-size", str(a.block_size)]
    return p.parse_args(argv)


def bench(a) -> dict:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    matmul_rate = matmul_flops_per_second(device, DTYPES[a.dtype])
    setup = load(script_arguments(a))
    cache, manager = SCRIPTS[a.script].allocate_kv_cache(setup)
    decoder = make_decoder(setup.model, cache, manager, len(setup.requests), not a.eager)
    prompts = [r.prompt_tokens for r in setup.requests]
    budgets = ([min(r.num_reply_tokens, a.new_tokens) for r in setup.requests] if a.sharegpt_replies
               else [a.new_tokens] * len(prompts))
    run = lambda prompts, budgets: generate_tokens(setup.model, cache, manager, prompts, budgets,
                                                   a.max_seq_len, stop_ids=set(), decoder=decoder)
    run(prompts[:8], [16] * min(8, len(prompts)))  # warm-up: kernels chosen, caches filled
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = run(prompts, budgets)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if result.num_generated_tokens != sum(budgets):
        raise UserError(f"{result.num_generated_tokens} tokens generated, {sum(budgets)} asked for: "
                        f"raise --max-seq-len so that every prompt has room for its new tokens.")

    # The attention kernel alone, halfway through: every request at its prompt + half its tokens.
    attention_seconds = attention_seconds_per_layer(
        setup, cache, [len(p) + b // 2 for p, b in zip(prompts, budgets)])
    kv_bytes_per_token = setup.model.args.kv_bytes_per_token(setup.dtype)
    weights_read = weight_bytes_read_per_step(setup.model)
    bounds = [(weights_read + s.filled_slots * kv_bytes_per_token) / bandwidth for s in result.timeline]
    by_time = sorted(range(len(result.timeline)), key=lambda i: result.timeline[i].seconds)
    median_step = by_time[len(by_time) // 2]
    step_seconds = result.timeline[median_step].seconds
    flops = prefill_flops(setup.model.args, [len(p) for p in prompts])
    return {
        "workload": vars(a) | {"json": str(a.json) if a.json else None},
        "device": torch.cuda.get_device_name(device),
        "copy_bandwidth_bytes_per_second": bandwidth,
        "matmul_flops_per_second": matmul_rate,
        "cuda_graphs": not isinstance(decoder, EagerDecoder),
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated_tokens": result.num_generated_tokens,
        "wall_seconds": wall,
        "output_tokens_per_second": result.num_generated_tokens / wall,
        "prefill_seconds": result.prefill_seconds,
        "prefill_flops": flops,
        "prefill_share_of_matmul_rate": flops / result.prefill_seconds / matmul_rate,
        "decode_seconds": result.decode_seconds,
        "decode_steps": result.decode_steps,
        "median_step": {"step": median_step, "seconds": step_seconds,
                        "live_requests": result.timeline[median_step].live_requests,
                        "weight_bytes": weights_read,
                        "kv_bytes": result.timeline[median_step].filled_slots * kv_bytes_per_token,
                        "bound_seconds": bounds[median_step],
                        "ratio_to_bound": step_seconds / bounds[median_step]},
        "attention_seconds_per_layer_halfway": attention_seconds,
        "median_ratio_to_bound": statistics.median(
            s.seconds / b for s, b in zip(result.timeline, bounds)),
        "step_seconds": [s.seconds for s in result.timeline],
        "bookkeeping_seconds_per_step_1000_live": {
            str(size): bookkeeping_seconds_per_step(size) for size in sorted({16, a.block_size})},
    }


def print_table(r: dict) -> None:
    w, m = r["workload"], r["median_step"]
    graphs = "CUDA graphs" if r["cuda_graphs"] else "eager"
    block = f", block {w['block_size']}" if w["script"] == "paged" else ""
    print(f"\n{w['script']}: {w['num_requests']} requests x {w['new_tokens']} new tokens"
          f"{' (ShareGPT reply lengths)' if w['sharegpt_replies'] else ''}, "
          f"{r['num_prompt_tokens']:,} prompt tokens; {w['model']} random weights, {w['dtype']}, "
          f"--attn {w['attn']}, {graphs}{block}; {r['device']}")
    print(f"  measured: copy bandwidth {r['copy_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s, "
          f"{w['dtype']} matmul {r['matmul_flops_per_second'] / 1e12:.0f} TFLOP/s")
    print(f"  wall                {r['wall_seconds']:.2f} s, {r['output_tokens_per_second']:,.0f} output tokens/s")
    print(f"  prefill             {r['prefill_seconds']:.2f} s, "
          f"{r['prefill_flops'] / r['prefill_seconds'] / 1e12:.0f} TFLOP/s = "
          f"{100 * r['prefill_share_of_matmul_rate']:.0f}% of the matmul rate")
    print(f"  decode              {r['decode_steps']} steps in {r['decode_seconds']:.2f} s")
    print(f"  median decode step  {m['seconds'] * 1e3:.2f} ms at batch {m['live_requests']}; bound "
          f"{m['bound_seconds'] * 1e3:.2f} ms ({m['weight_bytes'] / GB:.2f} GB weights + "
          f"{m['kv_bytes'] / GB:.2f} GB K/V); {m['ratio_to_bound']:.2f}x the bound")
    print(f"  attention kernel    {r['attention_seconds_per_layer_halfway'] * 1e6:.1f} us per layer, "
          f"every request at its prompt + half its new tokens")
    for size, seconds in r["bookkeeping_seconds_per_step_1000_live"].items():
        print(f"  block manager       {seconds * 1e3:.3f} ms per step, 1,000 live, block {size} (CPU)")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("bench.py"):
        if not torch.cuda.is_available():
            raise UserError("needs a CUDA GPU; the figures it reports are GPU limits.")
        result = bench(a)
    print_table(result)
    if a.json:
        a.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
