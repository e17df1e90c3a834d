"""When cascade attention pays: one layer's decode attention, plain against cascade, per shared
prefix length and batch size (features/cascade/attention.py's MIN_SHARED_TOKENS_READ comes from
here).

    python tools/cascade_cost.py                 # 8B's heads, blocks of 256, flash-attn, bf16
    python tools/cascade_cost.py --json cost.json

Each request holds the shared prefix's blocks, then blocks of its own: a random length from 1 to
twice --own-tokens, scattered over a pool of random K/V. Both ways are replayed as CUDA graphs,
as decode steps are, and timed with CUDA events after a warm-up (medians). Beside each, its
floor: the K/V bytes it must read at the copy bandwidth measured here (plain reads the prefix
once per request, the cascade once per step; its merge adds a few microseconds no floor counts).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("cascade_cost.py")  # before torch loads

from plumbing.cli import UserError

import torch

from llama3_paged import FlashAttention
from llama3_paged import DecodeBatch
from plumbing.inputs import PRESETS
from features.cascade.attention import CascadeAttention
from plumbing.cli import (HelpFormatter, first_paragraph, one_paragraph_errors, positive_int,
                          standard_json, writable_file, write_atomically)
from tools.arguments import positive_int_list
from tools.shared import as_graph, copy_bandwidth, median_cuda_seconds

BLOCK_SIZE = 256  # flash-attn's paged kernel


def microseconds(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--prefix-tokens", type=positive_int_list, default=[256, 512, 1024, 2048],
                   help=f"shared prefix lengths, multiples of {BLOCK_SIZE}")
    p.add_argument("--batches", type=positive_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="comma-separated batch sizes to time")
    p.add_argument("--own-tokens", type=positive_int, default=300,
                   help="mean tokens a request holds after the prefix")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    a = p.parse_args(argv)
    if any(n % BLOCK_SIZE for n in a.prefix_tokens):
        p.error(f"--prefix-tokens: multiples of {BLOCK_SIZE}, flash-attn's block, please")
    return a


def decode_batch(prefix_blocks: int, batch: int, own_tokens: int, pool_blocks: int, device):
    """Rows that list the prefix's blocks (0..P-1) first, then random blocks of their own."""
    own = torch.randint(1, 2 * own_tokens + 1, (batch,))
    own_blocks = -(-own // BLOCK_SIZE)
    table = torch.zeros(batch, prefix_blocks + int(own_blocks.max()), dtype=torch.int32)
    table[:, :prefix_blocks] = torch.arange(prefix_blocks)
    for r, n in enumerate(own_blocks.tolist()):
        table[r, prefix_blocks:prefix_blocks + n] = torch.randint(prefix_blocks, pool_blocks, (n,))
    seqlens = (own + prefix_blocks * BLOCK_SIZE).int()
    return DecodeBatch(slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
                       block_table=table.to(device), cache_seqlens=seqlens.to(device),
                       max_cache_seqlen=int(seqlens.max())), int(own.sum())


def measure(a) -> dict:
    device = torch.device("cuda")
    args = PRESETS["8b"]
    bandwidth = copy_bandwidth(device)
    bytes_per_token = 2 * args.n_kv_heads * args.head_dim * 2  # one layer's K and V, bf16
    pool_blocks = max(a.prefix_tokens) // BLOCK_SIZE + max(a.batches) * (2 * a.own_tokens // BLOCK_SIZE + 2)
    k, v = (torch.randn(pool_blocks, BLOCK_SIZE, args.n_kv_heads, args.head_dim, device=device,
                        dtype=torch.bfloat16) for _ in range(2))
    plain = FlashAttention()
    rows = []
    for prefix_tokens in a.prefix_tokens:
        prefix_blocks = prefix_tokens // BLOCK_SIZE
        cascade = CascadeAttention(plain, prefix_blocks, BLOCK_SIZE, device, min_batch=1)
        cascade.prefix_table[0] = torch.arange(prefix_blocks)
        for batch in a.batches:
            step, own = decode_batch(prefix_blocks, batch, a.own_tokens, pool_blocks, device)
            q = torch.randn(batch, args.n_heads, args.head_dim, device=device, dtype=torch.bfloat16)
            times = {name: median_cuda_seconds(as_graph(lambda b=backend: b.decode(q, k, v, step)))
                     for name, backend in (("plain", plain), ("cascade", cascade))}
            rows.append({"prefix_tokens": prefix_tokens, "batch": batch,
                         "plain_seconds": times["plain"], "cascade_seconds": times["cascade"],
                         "plain_floor_seconds": (batch * prefix_tokens + own) * bytes_per_token / bandwidth,
                         "cascade_floor_seconds": (prefix_tokens + own) * bytes_per_token / bandwidth})
    return {"device": torch.cuda.get_device_name(device), "copy_bandwidth": bandwidth,
            "own_tokens": a.own_tokens, "rows": rows}


def smallest_paying_batch(rows: list[dict], prefix_tokens: int) -> int | None:
    """The smallest batch from which the cascade is faster at that batch and every larger one."""
    mine = sorted((r for r in rows if r["prefix_tokens"] == prefix_tokens), key=lambda r: r["batch"])
    paying = None
    for r in reversed(mine):
        if r["cascade_seconds"] >= r["plain_seconds"]:
            break
        paying = r["batch"]
    return paying


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("cascade_cost.py"):
        if not torch.cuda.is_available():
            raise UserError("needs a CUDA GPU with flash-attn: the cascade is timed on its kernel.")
        result = measure(a)
        if a.json:
            write_atomically(a.json, lambda path: path.write_text(standard_json(result)))
        print(f"One layer's decode attention, Llama 3 8B's heads, blocks of {BLOCK_SIZE}, bf16; "
              f"{result['device']}; copy {result['copy_bandwidth'] / 1e12:.2f} TB/s; own tokens "
              f"1 to {2 * a.own_tokens} per request")
        print(f"{'prefix':>7} {'batch':>6} {'plain':>10} {'floor':>10} {'cascade':>10} {'floor':>10}"
              f"  cascade/plain")
        for r in result["rows"]:
            print(f"{r['prefix_tokens']:>7} {r['batch']:>6} {microseconds(r['plain_seconds']):>10} "
                  f"{microseconds(r['plain_floor_seconds']):>10} "
                  f"{microseconds(r['cascade_seconds']):>10} "
                  f"{microseconds(r['cascade_floor_seconds']):>10}  "
                  f"{r['cascade_seconds'] / r['plain_seconds']:.2f}x")
        for prefix_tokens in a.prefix_tokens:
            batch = smallest_paying_batch(result["rows"], prefix_tokens)
            print(f"  prefix {prefix_tokens}: the cascade pays "
                  + (f"from a batch of {batch}" if batch else "at no batch run"))


if __name__ == "__main__":
    main()
