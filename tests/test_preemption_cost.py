"""tools/preemption_cost.py (the paper's Figure 19): a timed swap brings every request's K/V back
exactly, into other blocks; the tool runs on the CPU and reports each block size."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import preemption_cost
from block_manager import BlockManager
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.swap import HostBlocks
from plumbing.inputs import PRESETS


def held_kv(cache, manager, requests):
    """Each request's K and V, read through its blocks in order."""
    blocks = lambda r: torch.tensor(manager.owned_blocks[r.row])
    as_blocks = lambda t: t[:, :cache.num_slots].view(t.shape[0], cache.num_blocks, cache.block_size, *t.shape[2:])
    return [(as_blocks(cache.k)[:, blocks(r)].clone(), as_blocks(cache.v)[:, blocks(r)].clone())
            for r in requests]


def test_a_timed_swap_returns_every_request_its_kv_in_other_blocks():
    args, tokens, block_size = PRESETS["tiny"], 40, 16
    cache = EngineKVCache(args, 24, block_size, torch.float32, torch.device("cpu"), TorchAttentionAfterPrefix())
    cache.k.normal_(), cache.v.normal_()
    manager = BlockManager(24, block_size, 3, 3)
    requests = preemption_cost.grown_requests(manager, 3, tokens)
    assert manager.owned_blocks[0][:2] == [0, 3], "grown together, their blocks interleave"
    before, blocks_before = held_kv(cache, manager, requests), dict(manager.owned_blocks)
    seconds = preemption_cost.swap_seconds(HostBlocks(cache, 9), manager, requests, tokens,
                                           preemption_cost.Timer(torch.device("cpu")))
    assert seconds > 0
    assert manager.owned_blocks != blocks_before
    for (k0, v0), (k1, v1) in zip(before, held_kv(cache, manager, requests)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_the_tool_reports_swap_and_recompute_per_block_size(tmp_path, capsys):
    out = tmp_path / "cost.json"
    preemption_cost.main(["--model", "tiny", "--device", "cpu", "--requests", "2", "--tokens",
                          "64", "--block-sizes", "16,64", "--repeats", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["block_size"] for r in result["rows"]] == [16, 64]
    assert [r["blocks_per_request"] for r in result["rows"]] == [4, 1]
    assert all(r["swap_seconds"] > 0 and r["recompute_seconds"] > 0 for r in result["rows"])
    assert result["kv_bytes"] == 2 * 64 * PRESETS["tiny"].kv_bytes_per_token(torch.float32)
    assert "swap/recompute" in capsys.readouterr().out
