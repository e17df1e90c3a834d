"""Tensor parallelism: one model split over the processes `torchrun` starts (Megatron-style).

    torchrun --nproc-per-node 2 llama3_paged.py 7 --random-weights --model tiny --device cpu

Each process (rank) holds a slice of every layer: its share of the query heads and of the K/V
heads (wqkv's rows, by head), of the feed-forward's hidden units (w_gate_up's rows), and the
matching columns of wo and w_down, whose partial outputs an all-reduce adds up; the output head
is split by vocabulary and its slices gathered. The embedding is whole on every rank. So a rank's
KV cache holds n_kv_heads / tp heads of every token: half the bytes per token on two ranks, and
the same memory holds twice the tokens. The block manager and its table do not change at all.

One scheduler, the same decisions on every rank (SPMD, as gpt-fast runs): each rank runs the
whole program, with the same requests, the same block manager and the same scheduler. The logits
are gathered whole on every rank, so every rank picks the same tokens (a sampler draws from the
same seeds), and every later decision follows the same. Nothing is broadcast but activations.
Only rank 0 prints and writes --json.

This first step runs on the CPU over gloo; a CUDA device is refused until NCCL on two GPUs has
been measured. Weights are loaded whole on each rank, then sliced: a checkpoint loader that reads
only a rank's slice is still to come.
"""

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from plumbing.cli import UserError

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a rank that stops answering ends the others


def world_size() -> int:
    """The processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start(device: torch.device) -> int:
    """Join the process group torchrun describes; this process's rank. Ranks other than 0 stay
    quiet on stdout (rank 0 prints the one report)."""
    if device.type != "cpu":
        raise UserError("Tensor parallelism runs on the CPU (gloo) in this version; on CUDA it "
                        "waits for NCCL on two GPUs. Use --device cpu, or run one process.")
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    return rank


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's slice of the input features; the all-reduce adds the
    ranks' partial outputs into the whole output."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)  # [T, out]: this rank's share of the sum
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """The output head over this rank's slice of the vocabulary; the gather puts the ranks'
    logits side by side: [T, vocab / tp] -> [T, vocab]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.linear(x).contiguous()
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=-1)


def rows(weight: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank's share of the rows: [n, ...] -> [n / tp, ...]."""
    share = weight.shape[0] // tp
    return weight[rank * share:(rank + 1) * share]


def sliced_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                       device=weight.device)
    linear.weight.data.copy_(weight)
    return linear


def shard_model(model, rank: int, tp: int) -> None:
    """Keep this rank's slice of every layer of `model` (llama3_paged.py's Llama), in place."""
    args = model.args
    for name, count in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                        ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
        if count % tp:
            raise UserError(f"The model's {name} ({count:,}) does not split over {tp} processes; "
                            f"run a number of processes that divides it.")
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    with torch.no_grad():
        for layer in model.layers:
            attention, ffn = layer.attention, layer.feed_forward
            wq, wk, wv = attention.wqkv.weight.split([q, kv, kv])  # by head, in head order
            attention.wqkv = sliced_linear(torch.cat([rows(w, rank, tp) for w in (wq, wk, wv)]))
            attention.wo = RowParallelLinear(sliced_linear(rows(attention.wo.weight.T, rank, tp).T))
            attention.n_heads, attention.n_kv_heads = args.n_heads // tp, args.n_kv_heads // tp
            gate, up = ffn.w_gate_up.weight.chunk(2)
            ffn.w_gate_up = sliced_linear(torch.cat([rows(gate, rank, tp), rows(up, rank, tp)]))
            ffn.w_down = RowParallelLinear(sliced_linear(rows(ffn.w_down.weight.T, rank, tp).T))
        model.output = VocabParallelHead(sliced_linear(rows(model.output.weight, rank, tp)))
    # The shapes this rank holds: the KV cache and its bytes per token are sized from them.
    model.args = dataclasses.replace(args, n_heads=args.n_heads // tp,
                                     n_kv_heads=args.n_kv_heads // tp, ffn_dim=args.ffn_dim // tp,
                                     head_dim=args.head_dim)


def stop() -> None:
    """Leave the process group once every rank is done (a barrier first: no rank leaves while
    another still waits on it)."""
    dist.barrier()
    dist.destroy_process_group()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def report_line(run, tp: int) -> str:
    """What each process holds, for rank 0's report."""
    from plumbing.cli import format_bytes
    return (f"Tensor parallel over {tp} processes: each holds {format_bytes(weight_bytes(run.model))}"
            f" of weights and {run.kv_bytes_per_token // 1024} KiB of K/V per token "
            f"({run.model.args.n_kv_heads} of {run.model.args.n_kv_heads * tp} K/V heads); the "
            f"report's KV figures are one process's, every process's the same")
