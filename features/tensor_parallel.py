"""Tensor parallelism: one model split over the processes `torchrun` starts (Megatron-style).

    torchrun --nproc-per-node 2 llama3_paged.py 7 --random-weights --model tiny --device cpu
    torchrun --nproc-per-node 2 llama3_paged.py 49 --random-weights    # two GPUs, over NCCL

More in docs/engine-notes.md.
"""

import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import llama3_paged as lesson
from plumbing.cli import GPU_MEMORY_UTILIZATION, UserError, format_bytes, per_token
from plumbing.inputs import Share

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a rank that stops answering ends the others


def start(config):
    """Join torchrun's process group over the transport the device calls for; the config this
    rank runs: its GPU, and on ranks other than 0 no --json (rank 0 prints the one report and
    writes the file; the others stay quiet on stdout)."""
    refuse_what_is_not_split_yet(config)
    backend, local_size = "gloo", int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    changes = {"compile": bool(config.compile)}  # default off: compiled layers with collectives
    if config.device.type == "cuda":               # inside are not run yet
        if config.device.index is not None:
            raise UserError("Under torchrun each process takes the GPU its LOCAL_RANK names: pass "
                            "--device cuda, without an index.")
        if torch.cuda.device_count() >= local_size:  # a GPU each: NCCL, graphs can capture it
            backend = "nccl"
            changes["device"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(changes["device"])
        else:  # the processes share one GPU, and its memory
            changes |= {"device": torch.device("cuda", 0),
                        "eager": True,  # no CUDA graphs (nor compiled layers) over gloo
                        "gpu_memory_utilization": (config.gpu_memory_utilization
                                                   or GPU_MEMORY_UTILIZATION) / local_size}
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")
        changes["json"] = None
    return dataclasses.replace(config, **changes)


def group():
    """The processes start() joined: what a feature that computes over them all is handed (FP8's
    scales, the largest value over every process's slice, and its sums), not torch's globals."""
    return dist.group.WORLD


def refuse_what_is_not_split_yet(args) -> None:
    """Compiled layers, with all-reduces inside the compiled code, are not run over several
    processes yet: an explicit --compile ends here, in one paragraph, before loading."""
    if args.compile:
        raise UserError("--compile does not run under torchrun yet (tensor parallelism): run it "
                        "in one process, or drop the flag.")


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's slice of the input features; the all-reduce adds the
    ranks' partial outputs into the whole output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [T, out]: this rank's share of the sum
        dist.all_reduce(out)
        return out


class VocabParallelHead(nn.Module):
    """The output head over this rank's slice of the vocabulary, `rows` of `weight` (its own
    slice, or, where the model ties head and embedding, the embedding's rows); the gather puts
    the ranks' logits side by side: [T, vocab / tp] -> [T, vocab]."""

    def __init__(self, weight: nn.Parameter, rows: slice):
        super().__init__()
        self.weight, self.rows = weight, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight[self.rows])  # [T, vocab / tp]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=-1)


class SplitLlama(lesson.Llama):
    """llama3_paged.py's Llama with this rank's slice of every layer. Its `args` are the slice's
    shapes (the KV cache is sized from them: n_kv_heads / tp heads); `whole_args` the model's."""

    def __init__(self, args, dtype: torch.dtype):
        rank, tp = dist.get_rank(), dist.get_world_size()
        for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(args, name) % tp:
                raise UserError(f"The model's {name} ({getattr(args, name):,}) does not split over "
                                f"{tp} processes; run a number of processes that divides it.")
        super().__init__(dataclasses.replace(
            args, n_heads=args.n_heads // tp, n_kv_heads=args.n_kv_heads // tp,
            ffn_dim=args.ffn_dim // tp, head_dim=args.head_dim), dtype)
        self.rank, self.tp, self.whole_args = rank, tp, args
        for layer in self.layers:
            wo, w_down = layer.attention.wo, layer.feed_forward.w_down
            layer.attention.wo = RowParallelLinear(wo.in_features, wo.out_features, bias=False,
                                                   dtype=dtype)
            layer.feed_forward.w_down = RowParallelLinear(w_down.in_features, w_down.out_features,
                                                          bias=False, dtype=dtype)
        share = args.vocab_size // tp
        if args.tie_embeddings:  # the embedding's rows, no copy (plumbing/inputs.py ties them)
            self.output = VocabParallelHead(self.tok_embeddings.weight,
                                            slice(rank * share, (rank + 1) * share))
        else:
            self.output = VocabParallelHead(nn.Parameter(torch.empty(share, args.dim, dtype=dtype)),
                                            slice(None))

    def share_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of one whole tensor of parameter `name` (or of one part of a merged
        one: q, k or v of wqkv, gate or up of w_gate_up), as a checkpoint holds it."""
        if name.endswith(("wo.weight", "w_down.weight")):  # row-parallel: its input features
            return tensor.tensor_split(self.tp, dim=1)[self.rank]
        if name.endswith(("wqkv.weight", "w_gate_up.weight", "output.weight")):  # heads, units, words
            return tensor.tensor_split(self.tp, dim=0)[self.rank]
        return tensor  # the embedding and the norms: whole on every rank


# What the loader (plumbing/inputs.py) builds and copies in: each rank's slice of every weight
SHARE = Share(SplitLlama, SplitLlama.share_of)


def least_over_processes(value: float) -> float:
    """The smallest of every process's `value`. Each process measures its own GPU's free memory
    for the KV budget, and two GPUs can differ by a few megabytes: with the smallest budget
    everywhere, every process sizes the same pool, so all run out of blocks at the same step
    (--find-max-batch's attempts end together) instead of one waiting for the others forever."""
    return reduced([value], dist.ReduceOp.MIN)[0]


def reduced(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Each of `values` reduced over the processes (float64, on the device the transport reads:
    NCCL a GPU's, gloo the host's)."""
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def transport(device: torch.device) -> str:
    where = ("each on a GPU of its own" if dist.get_backend() == "nccl" else
             "sharing one GPU" if torch.device(device).type == "cuda" else "on the CPU")
    return f"{dist.get_backend()}, {where}"


def summed_over_processes(memory: dict, device: torch.device) -> dict:
    """The report's memory figures of every process (engine/report.py's), added up: each holds
    its own pool, and its own unfilled slots."""
    names = ["weights_bytes", "kv_pool_bytes", "fragmented_bytes"]
    totals = reduced([float(memory[n]) for n in names])
    return {"processes": dist.get_world_size(), "transport": transport(device),
            **{n: int(v) for n, v in zip(names, totals)}}


def report_line(memory: dict, model) -> str:
    """What each process holds, and the sums, for rank 0's report."""
    summed, a = memory["summed_over_processes"], model.whole_args
    n = summed["processes"]
    return (f"Tensor parallel over {n} process{'es' if n > 1 else ''} ({summed['transport']}): each "
            f"holds {format_bytes(memory['weights_bytes'])} of weights, "
            f"{per_token(memory['kv_bytes_per_token'])} of K/V per token ({model.args.n_kv_heads} "
            f"of {a.n_kv_heads} K/V heads) in {memory['kv_pool_blocks']:,} {memory['kv_pool_unit']}; "
            f"summed over the processes: weights {format_bytes(summed['weights_bytes'])}, KV pool "
            f"{format_bytes(summed['kv_pool_bytes'])}, Fragmented Memory "
            f"{format_bytes(summed['fragmented_bytes'])} (the figures above are one process's)")

