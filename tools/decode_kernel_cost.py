"""The decode attention kernels side by side: flash-attn's paged kernel against the Triton kernel
(features/triton_attention.py) at several tile sizes and warp counts, on one layer's cache.

    python tools/decode_kernel_cost.py                      # every case, blocks of 256 and 16
    python tools/decode_kernel_cost.py --cases W W2-first --tiles 16,32,64 --warps 1,2

Each case is a batch of requests with random lengths (uniform between two bounds; W2-median's and
W2-first's are W2's own at its middle and first decode steps), longest first as the engine orders
them, their K/V of random values in blocks scattered over the pool, Llama 3 8B's heads (32 query
heads, 8 K/V heads of 128). The Triton kernel is timed at every tile and warp count on the K/V
in bf16 and again in float8 (features/fp8/cache.py: half the bytes).
Each kernel is captured as a CUDA graph, as decode steps run it, so that Python's time to launch it
is not counted (a Triton launch from Python takes tens of microseconds, as long as the kernel at
W's lengths), and the replays are timed with CUDA events after a warm-up (medians). Each is set
against reading the same K/V at the copy bandwidth measured in the same run. flash-attn reads
blocks of 256 and up only; with blocks of 16 the Triton kernel is timed alone.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("decode_kernel_cost.py")  # before torch loads

from plumbing.cli import UserError, importable

import torch

from plumbing.cli import HelpFormatter, first_paragraph, one_paragraph_errors, writable_file
from tools.arguments import positive_int_list
from tools.shared import as_graph, copy_bandwidth, median_cuda_seconds, write_and_print

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama 3 8B


def drawn(batch: int, fewest: int, most: int):
    """`batch` requests' cached tokens, each uniform in fewest..most."""
    return lambda generator, device: torch.randint(fewest, most + 1, (batch,), device=device,
                                                   generator=generator, dtype=torch.int32)


def w2_step(which: str):
    """W2's own requests' lengths at its "first" or "median" decode step (w2_step_lengths)."""
    return lambda generator, device: torch.tensor(w2_step_lengths(which), device=device,
                                                  dtype=torch.int32)


# name: (each request's cached tokens [B], block size). W's requests halfway through their 256
# new tokens; W2's at a typical step (batch 220, replies of up to 2,048 tokens); W2 at batch 512;
# W2-median, W2-first: not drawn, W2's own requests at its decode step of median batch and at its
# first (all 2,000 at their prompts' lengths: the short, wide steps), below.
CASES = {
    "W": (drawn(256, 140, 400), 256),
    "W2": (drawn(220, 200, 2400), 256),
    "W2-512": (drawn(512, 200, 2400), 256),
    "N": (drawn(256, 200, 1500), 256),  # prompts of 100-1,024 tokens, partway through their replies
    "W-16": (drawn(256, 140, 400), 16),
    "W2-16": (drawn(220, 200, 2400), 16),
    "W2-median": (w2_step("median"), 256),
    "W2-first": (w2_step("first"), 256),
}


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   metavar="CASE",
                   help=f"{', '.join(CASES)} (default: all)")
    p.add_argument("--tiles", type=positive_int_list, default=[32, 64, 128],
                   help="tokens the Triton kernel loads per step, powers of 2")
    p.add_argument("--warps", type=positive_int_list, default=[1, 2, 4],
                   help="warps per Triton program (powers of two)")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    a = p.parse_args(argv)
    for value in a.tiles + a.warps:
        if value & (value - 1):
            p.error(f"--tiles and --warps take powers of two; {value} is not one.")
    if min(a.tiles) < 16:
        p.error("--tiles must be 16 or more: the kernel's matmuls need 16 rows.")
    return a


def w2_step_lengths(which: str) -> list[int]:
    """Each running request's cached tokens at W2's first decode step or its step of median
    batch (tools/bench.py --workload W2): its prompt and the tokens made so far. The H200's pool
    holds all 2,000 requests, so every prompt is prefilled before the first decode step; then each
    request grows a token a step until its reply's length (end-of-text ignored), its first token
    from the prefill: a reply of r tokens runs decode steps 0 .. r - 2."""
    from tools import bench
    from plumbing.inputs import load_prompts, load_tokenizer
    w2, tokenizer = bench.parse_arguments(["paged", "--workload", "W2"]), load_tokenizer()
    prompts, replies = bench.workload_requests(load_prompts(w2.num_requests, tokenizer),
                                               tokenizer, w2)
    # The batch only shrinks: the middle step has the median one.
    step = 0 if which == "first" else (max(replies) - 1) // 2
    return [len(p) + step + 1 for p, r in zip(prompts, replies) if r - 2 >= step]


def one_case(name: str, device) -> dict:
    """The kernels' inputs: q [B, 32, 128], a pool [blocks, block_size, 8, 128] for K and for V,
    a block table [B, max_blocks] over a random permutation of the pool, the lengths [B]."""
    cached_tokens, block_size = CASES[name]
    g = torch.Generator(device=device).manual_seed(0)
    # In the order the engine launches a decode step's rows: longest first (longest_first.py).
    lengths = cached_tokens(g, device).sort(descending=True).values
    batch = len(lengths)
    blocks_each = [math.ceil(n / block_size) for n in lengths.tolist()]
    order = torch.randperm(sum(blocks_each), device=device, generator=g).int()
    table = torch.zeros(batch, max(blocks_each), dtype=torch.int32, device=device)
    for r, start in enumerate(torch.tensor([0] + blocks_each).cumsum(0)[:-1].tolist()):
        table[r, :blocks_each[r]] = order[start:start + blocks_each[r]]
    pool = (len(order), block_size, N_KV_HEADS, HEAD_DIM)
    keys = torch.randn(pool, device=device, generator=g).bfloat16()
    values = torch.randn(pool, device=device, generator=g).bfloat16()
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device=device, generator=g).bfloat16()
    return {"q": q, "keys": keys, "values": values, "table": table, "lengths": lengths,
            "batch": batch, "block_size": block_size,
            "kv_bytes": int(lengths.sum()) * 2 * N_KV_HEADS * HEAD_DIM * 2}


def measure(a) -> dict:
    from flash_attn import flash_attn_with_kvcache
    from features.fp8.cache import quantize, scales_for
    from features.triton_attention import paged_decode
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    cases = []
    for name in a.cases:
        c = one_case(name, device)
        batch, block_size = c["batch"], c["block_size"]
        row = {"case": name, "batch": batch, "block_size": block_size, "kv_bytes": c["kv_bytes"],
               "floor_seconds": c["kv_bytes"] / bandwidth, "flash_seconds": None, "triton": []}
        flash_out = None
        if block_size % 256 == 0:
            flash = lambda: flash_attn_with_kvcache(c["q"][:, None], c["keys"], c["values"],
                                                    cache_seqlens=c["lengths"],
                                                    block_table=c["table"], causal=True)[:, 0]
            row["flash_seconds"], flash_out = median_cuda_seconds(as_graph(flash)), flash()
        # The same K/V in float8 (features/fp8/cache.py): half the bytes read; its difference
        # is from the bf16 Triton kernel's output at the same tile and warps.
        amax = torch.stack([c["keys"].abs().amax(), c["values"].abs().amax()]).float()
        scales = scales_for(amax)  # as the cache's first prefill sets them
        keys8, values8 = quantize(c["keys"], scales[0]), quantize(c["values"], scales[1])
        row["triton_fp8"] = []
        for tile in a.tiles:
            for warps in a.warps:
                triton = lambda t=tile, w=warps: paged_decode(c["q"], c["keys"], c["values"],
                                                             c["table"], c["lengths"], tile=t,
                                                             num_warps=w)
                seconds, out = median_cuda_seconds(as_graph(triton)), triton()
                differs = None if flash_out is None else (out.float() - flash_out.float()).abs().max().item()
                row["triton"].append({"tile": tile, "warps": warps, "seconds": seconds,
                                      "max_difference_from_flash": differs})
                fp8 = lambda t=tile, w=warps: paged_decode(c["q"], keys8, values8, c["table"],
                                                          c["lengths"], kv_scales=scales, tile=t,
                                                          num_warps=w)
                row["triton_fp8"].append({
                    "tile": tile, "warps": warps, "seconds": median_cuda_seconds(as_graph(fp8)),
                    "max_difference_from_bf16": (fp8().float() - out.float()).abs().max().item()})
        cases.append(row)
    return {"device": torch.cuda.get_device_name(device),
            "copy_bandwidth_bytes_per_second": bandwidth, "cases": cases}


def print_table(result: dict) -> None:
    print(f"One layer's decode attention, bf16, {N_HEADS} query heads, {N_KV_HEADS} K/V heads of "
          f"{HEAD_DIM}; {result['device']}, copy bandwidth "
          f"{result['copy_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s")
    print(f"{'case':<8} {'batch':>5} {'block':>5} {'K/V':>8} {'floor':>9}  {'kernel':<22} {'time':>9} "
          f"{'reads':>10} {'max |diff| from flash':>22}")
    for r in result["cases"]:
        head = (f"{r['case']:<8} {r['batch']:>5} {r['block_size']:>5} {r['kv_bytes'] / 1e9:>5.2f} GB "
                f"{r['floor_seconds'] * 1e6:>6.1f} us")
        kernels = [("flash-attn", r["flash_seconds"], None)] if r["flash_seconds"] else []
        kernels += [(f"Triton, tile {t['tile']}, {t['warps']} warps", t["seconds"],
                     t["max_difference_from_flash"]) for t in r["triton"]]
        for i, (kernel, seconds, differs) in enumerate(kernels):
            print(f"{head if i == 0 else '':<37}  {kernel:<22} {seconds * 1e6:>6.1f} us "
                  f"{r['kv_bytes'] / seconds / 1e12:>5.2f} TB/s "
                  f"{'' if differs is None else f'{differs:.1e}':>22}")
        for f in r["triton_fp8"]:  # reads half the bytes: its TB/s is of the bytes it reads
            kernel = f"fp8, tile {f['tile']}, {f['warps']} warps"
            print(f"{'':<37}  {kernel:<22} {f['seconds'] * 1e6:>6.1f} us "
                  f"{r['kv_bytes'] / 2 / f['seconds'] / 1e12:>5.2f} TB/s "
                  f"{f['max_difference_from_bf16']:.1e} from bf16")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("decode_kernel_cost.py"):
        if not (torch.cuda.is_available() and importable("flash_attn") and importable("triton")):
            raise UserError("needs a CUDA GPU with flash-attn and Triton: it times their kernels "
                            "on it.")
        write_and_print(measure(a), a.json, print_table)


if __name__ == "__main__":
    main()
