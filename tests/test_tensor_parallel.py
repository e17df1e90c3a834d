"""Tensor parallelism on the CPU: torchrun's two processes over gloo give the one process's tokens,
each holding half of every token's K/V."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from features.tensor_parallel import shard_model
from llama3_paged import KVCache, Llama, TorchAttention
from plumbing.inputs import random_model

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def run(argv, out, processes: int) -> dict:
    """A script's --json, run in one process or over torchrun's two."""
    launcher = TORCHRUN if processes == 2 else [sys.executable]
    done = subprocess.run([*launcher, *argv, "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()) | {"stdout": done.stdout}


@pytest.mark.parametrize("flags", [
    [],  # a static batch
    ["--continuous", "--num-blocks", "10"],  # too few blocks: preemption and recompute
    ["--samples", "2"],  # forks that share their prompt's blocks
], ids=["static", "continuous-preempting", "samples"])
def test_two_processes_give_the_one_process_tokens_with_half_the_kv_per_token(flags, tmp_path):
    argv = ["llama3_paged.py", "4", *TINY, "--max-new-tokens", "40", *flags]
    one = run(argv, tmp_path / "one.json", 1)
    two = run(argv, tmp_path / "two.json", 2)
    assert [r["output_tokens"] for r in two["requests"]] == [r["output_tokens"] for r in one["requests"]]
    assert two["memory"]["kv_bytes_per_token"] * 2 == one["memory"]["kv_bytes_per_token"]
    assert two["stdout"].count("Fragmented Memory") == 1, "rank 0 alone reports"
    assert "Tensor parallel over 2 processes" in two["stdout"]
    if "--continuous" in flags:
        assert two["preemptions"] == one["preemptions"] > 0


def test_each_ranks_slices_together_are_the_whole_layer_and_hold_half_the_kv_heads():
    whole = random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=3)
    ranks = [random_model(Llama, "tiny", "cpu", torch.float32, 64, seed=3) for _ in range(2)]
    for rank, model in enumerate(ranks):
        shard_model(model, rank, 2)
    args = whole.args
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    wq, wk, wv = whole.layers[0].attention.wqkv.weight.split([q, kv, kv])
    parts = [m.layers[0].attention.wqkv.weight.split([q // 2, kv // 2, kv // 2]) for m in ranks]
    for i, w in enumerate((wq, wk, wv)):
        assert torch.equal(torch.cat([p[i] for p in parts]), w)
    assert torch.equal(torch.cat([m.layers[0].attention.wo.linear.weight for m in ranks], dim=1),
                       whole.layers[0].attention.wo.weight)
    assert torch.equal(torch.cat([m.output.linear.weight for m in ranks]), whole.output.weight)
    cache = KVCache(ranks[0].args, 4, 16, torch.float32, "cpu", TorchAttention())
    assert cache.block_shape == (4, 16, args.n_kv_heads // 2, args.head_dim)


def test_a_killed_rank_ends_the_other_within_bounded_time(tmp_path):
    launcher = subprocess.Popen([*TORCHRUN, "llama3_paged.py", "7", *TINY, "--max-new-tokens",
                                 "2000"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    seen = b""
    while b"decode" not in seen and time.monotonic() < deadline:  # both ranks are decoding
        seen += os.read(launcher.stderr.fileno(), 4096)
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 2, children
    os.kill(int(children[1]), signal.SIGKILL)
    start = time.monotonic()
    launcher.communicate(timeout=90)
    assert launcher.returncode != 0
    assert time.monotonic() - start < 90
    assert all(subprocess.run(["kill", "-0", c], capture_output=True).returncode != 0
               for c in children), "no rank is left running"
