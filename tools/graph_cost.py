"""When CUDA graphs pay: one decode step of the 8B model launched kernel by kernel from Python,
against the same step replayed as one CUDA graph, per batch size.

    python tools/graph_cost.py                          # random 8B weights, flash-attn, bf16
    python tools/graph_cost.py --batches 256,1024 --context-tokens 512

features/cuda_graphs.py captures a graph per batch bucket up to 512 and runs larger batches
eagerly; this measures whether that costs anything. Each request holds --context-tokens tokens of
random K/V in blocks of 256. Both ways are timed with CUDA events after a warm-up (medians), beside
the step's floor as tools/bench.py computes it: the projections at the measured matmul rate or the
weights read at the measured copy bandwidth, whichever is longer, plus the K/V read.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("graph_cost.py")  # before torch loads

from plumbing.cli import UserError, importable

import numpy as np
import torch

from block_manager import BlockManager
from features.cuda_graphs import KVCacheWithSpareSlot
from features.request_state import ServedRequest
from llama3_paged import FlashAttention
from llama3_paged import Decoder
from plumbing.inputs import random_model
from llama3_paged import Llama
from plumbing.cli import (HelpFormatter, first_paragraph, one_paragraph_errors, positive_int,
                          positive_int_list, writable_file)
from tools.bench import decode_flops_per_token, step_floor_seconds, weight_bytes_read_per_step
from tools.shared import (as_graph, copy_bandwidth, matmul_flops_per_second, median_cuda_seconds,
                          write_and_print)

BLOCK_SIZE = 256  # flash-attn's paged kernel, as tools/bench.py runs it


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--batches", type=positive_int_list, default=[64, 256, 512, 1024, 2048],
                   help="decode batch sizes")
    p.add_argument("--context-tokens", type=positive_int, default=255,
                   help="tokens each request has cached, the new one not counted")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    return p.parse_args(argv)


def one_batch(model, batch: int, context: int, device) -> dict:
    """A pool holding `batch` requests of `context` random tokens; the step's inputs on device."""
    blocks_each = -(-(context + 1) // BLOCK_SIZE)
    cache = KVCacheWithSpareSlot(model.args, batch * blocks_each, BLOCK_SIZE, torch.bfloat16, device,
                    FlashAttention())
    cache.k.normal_(), cache.v.normal_()
    manager = BlockManager(batch * blocks_each, BLOCK_SIZE, batch, blocks_each, device)
    for r in range(batch):
        manager.allocate(ServedRequest(r, [0] * context, 1))
    rows, positions = np.arange(batch), np.full(batch, context)
    manager.append_token(rows)
    inputs = [torch.randint(model.args.vocab_size, (batch,), device=device)]
    inputs += [torch.from_numpy(a).to(device) for a in (positions, rows, manager.slots(rows, positions))]
    return {"cache": cache, "manager": manager, "inputs": inputs}


def measure(a) -> dict:
    device = torch.device("cuda")
    hardware = {"copy_bandwidth_bytes_per_second": copy_bandwidth(device),
                "matmul_flops_per_second": matmul_flops_per_second(device, torch.bfloat16)}
    model = random_model(Llama, "8b", device, torch.bfloat16, a.context_tokens + 1, seed=0)
    per_token, weights = decode_flops_per_token(model.args), weight_bytes_read_per_step(model)
    kv_per_token = model.args.kv_bytes_per_token(torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for batch in a.batches:
            step = one_batch(model, batch, a.context_tokens, device)
            decoder = Decoder(model, step["cache"], step["manager"].block_table)
            decode = lambda d=decoder, s=step: d.decode(*s["inputs"], a.context_tokens + 1)
            eager = median_cuda_seconds(decode, repeats=10)
            graph = median_cuda_seconds(as_graph(decode), repeats=10)
            floor = step_floor_seconds(batch, batch * (a.context_tokens + 1) * kv_per_token,
                                       weights, per_token, hardware)
            rows.append({"batch": batch, "eager_seconds": eager, "graph_seconds": graph,
                         "floor_seconds": floor})
            del step, decoder
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), "context_tokens": a.context_tokens,
            **hardware, "rows": rows}


def print_table(result: dict) -> None:
    print(f"One decode step, random 8B weights, bf16, flash-attn, blocks of {BLOCK_SIZE}, "
          f"{result['context_tokens']} tokens cached per request; {result['device']}")
    print(f"{'batch':>6} {'eager':>10} {'graph':>10} {'eager/graph':>12} {'floor':>10}")
    for r in result["rows"]:
        print(f"{r['batch']:>6} {r['eager_seconds'] * 1e3:>7.2f} ms {r['graph_seconds'] * 1e3:>7.2f} ms "
              f"{r['eager_seconds'] / r['graph_seconds']:>11.2f}x {r['floor_seconds'] * 1e3:>7.2f} ms")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("graph_cost.py"):
        if not torch.cuda.is_available() or not importable("flash_attn"):
            raise UserError("needs a CUDA GPU with flash-attn: a decode step is timed on it.")
        write_and_print(measure(a), a.json, print_table)


if __name__ == "__main__":
    main()
