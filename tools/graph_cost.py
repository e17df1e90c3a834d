"""When CUDA graphs pay: one decode step of the 8B model launched kernel by kernel from Python,
against the same step replayed as one CUDA graph, per batch size.

    python tools/graph_cost.py                          # random 8B weights, flash-attn, bf16
    python tools/graph_cost.py --batches 256,1024 --context-tokens 512
    python tools/graph_cost.py --compile --batches 512,640,768,1024

features/cuda_graphs.py captures a graph per batch bucket up to 1,024 and runs larger batches
eagerly; this measures whether that costs anything. Each request holds --context-tokens tokens of
random K/V in blocks of 256. With --compile the layers are compiled (engine/compiled_layers.py,
the default on CUDA): the graphs replay the compiled kernels, and a third column times the
compiled step launched from Python, which engine/compiled_layers.py avoids below 600 rows.
All are timed with CUDA events after a warm-up (medians), beside the step's floor as
tools/bench.py computes it: the projections at the measured matmul rate or the weights read at
the measured copy bandwidth, whichever is longer, plus the K/V read.
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
from engine.kv_cache import EngineKVCache
from engine.model_runner import ModelForward, SamplingDecoder
from engine.request import EngineRequest
from llama3_paged import FlashAttention
from plumbing.inputs import random_model
from llama3_paged import Llama
from plumbing.cli import (HelpFormatter, first_paragraph, one_paragraph_errors, positive_int,
                          writable_file)
from tools.arguments import positive_int_list
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
    p.add_argument("--compile", action="store_true",
                   help="compiled layers: graphs of them, and launched from Python")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    return p.parse_args(argv)


def one_pool(model, largest_batch: int, context: int, device):
    """A pool holding `largest_batch` requests of `context` random tokens each. One pool for every
    batch size, so that compiled layers compile once (around this cache's attention)."""
    blocks_each = -(-(context + 1) // BLOCK_SIZE)
    cache = EngineKVCache(model.args, largest_batch * blocks_each, BLOCK_SIZE, torch.bfloat16,
                          device, FlashAttention(), spare_slot=True)
    cache.k.normal_(), cache.v.normal_()
    manager = BlockManager(largest_batch * blocks_each, BLOCK_SIZE, largest_batch, blocks_each, device)
    for r in range(largest_batch):
        manager.allocate(EngineRequest(r, [0] * context, 1))
    manager.append_token(np.arange(largest_batch))
    return cache, manager


def step_inputs(model, manager, batch: int, context: int, device) -> list[torch.Tensor]:
    """A decode step of the pool's first `batch` requests: tokens, positions, rows, slots."""
    rows, positions = np.arange(batch), np.full(batch, context)
    inputs = [torch.randint(model.args.vocab_size, (batch,), device=device)]
    return inputs + [torch.from_numpy(a).to(device)
                     for a in (positions, rows, manager.slots(rows, positions))]


def measure(a) -> dict:
    device = torch.device("cuda")
    hardware = {"copy_bandwidth_bytes_per_second": copy_bandwidth(device),
                "matmul_flops_per_second": matmul_flops_per_second(device, torch.bfloat16)}
    model = random_model(Llama, "8b", device, torch.bfloat16, a.context_tokens + 1, seed=0)
    per_token, weights = decode_flops_per_token(model.args), weight_bytes_read_per_step(model)
    kv_per_token = model.args.kv_bytes_per_token(torch.bfloat16)
    cache, manager = one_pool(model, max(a.batches), a.context_tokens, device)
    forward = ModelForward(model, compiled=a.compile)
    decoder, rows = SamplingDecoder(forward, cache, manager.block_table), []  # the engine's step
    with torch.inference_mode():
        for batch in a.batches:
            inputs = step_inputs(model, manager, batch, a.context_tokens, device)
            decode = lambda: decoder.decode(*inputs, a.context_tokens + 1)
            with torch.compiler.set_stance("force_eager"):  # the lesson's kernels
                eager = median_cuda_seconds(decode, repeats=10)
            with forward.at_any_length():  # compiled, if --compile, at every batch
                compiled = median_cuda_seconds(decode, repeats=10) if a.compile else None
                graph = median_cuda_seconds(as_graph(decode), repeats=10)
            floor = step_floor_seconds(batch, batch * (a.context_tokens + 1) * kv_per_token,
                                       weights, per_token, hardware)
            rows.append({"batch": batch, "eager_seconds": eager, "compiled_seconds": compiled,
                         "graph_seconds": graph, "floor_seconds": floor})
    return {"device": torch.cuda.get_device_name(device), "context_tokens": a.context_tokens,
            "compiled": a.compile, **hardware, "rows": rows}


def print_table(result: dict) -> None:
    layers = "compiled layers" if result["compiled"] else "eager layers"
    print(f"One decode step, random 8B weights, bf16, flash-attn, blocks of {BLOCK_SIZE}, "
          f"{result['context_tokens']} tokens cached per request, graphs of {layers}; "
          f"{result['device']}")
    compiled = " compiled from Python" if result["compiled"] else ""
    print(f"{'batch':>6} {'eager':>10}{compiled} {'graph':>10} {'eager/graph':>12} {'floor':>10}")
    for r in result["rows"]:
        from_python = (f" {r['compiled_seconds'] * 1e3:>17.2f} ms" if result["compiled"] else "")
        print(f"{r['batch']:>6} {r['eager_seconds'] * 1e3:>7.2f} ms{from_python} "
              f"{r['graph_seconds'] * 1e3:>7.2f} ms "
              f"{r['eager_seconds'] / r['graph_seconds']:>11.2f}x {r['floor_seconds'] * 1e3:>7.2f} ms")


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("graph_cost.py"):
        if not torch.cuda.is_available() or not importable("flash_attn"):
            raise UserError("needs a CUDA GPU with flash-attn: a decode step is timed on it.")
        write_and_print(measure(a), a.json, print_table)


if __name__ == "__main__":
    main()
