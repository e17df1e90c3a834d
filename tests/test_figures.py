"""The figures the README prints, computed here from first principles and held against the code."""

import json
import signal

import pytest
import torch

import llama3_naive
import llama3_paged
from core.model import PRESETS

signal.signal(signal.SIGINT, signal.default_int_handler)  # the scripts' import replaced pytest's

TINY = ["--random-weights", "--model", "tiny", "--device", "cpu"]
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # K and V x 2 layers x 2 KV heads x 64 values x fp32


def test_a_token_of_llama3_8b_costs_128_kib_of_kv_cache():
    # K and V, 32 layers, 8 KV heads of 128 values, 2 bytes each in bf16.
    assert PRESETS["8b"].kv_bytes_per_token(torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert PRESETS["tiny"].kv_bytes_per_token(torch.float32) == TINY_BYTES_PER_TOKEN


@pytest.mark.parametrize("budget_gb, block_size", [(0.01, 16), (0.125, 16), (0.05, 48)])
def test_the_paged_pool_is_the_kv_budget_in_whole_blocks(budget_gb, block_size, tmp_path):
    llama3_paged.main([*TINY, "1", "--max-new-tokens", "2", "--kv-budget-gb", str(budget_gb),
                       "--block-size", str(block_size), "--json", str(tmp_path / "run.json")])
    memory = json.loads((tmp_path / "run.json").read_text())["memory"]
    assert memory["kv_pool_blocks"] == int(budget_gb * 1e9 // (block_size * TINY_BYTES_PER_TOKEN))


def test_on_the_cpu_the_naive_cache_fits_7_requests_of_8192_tokens(tmp_path):
    # 0.125 GB / (8,192 tokens x 2 KiB) = 7.45: seven max-length caches fit, an eighth does not.
    llama3_naive.main([*TINY, "7", "--max-new-tokens", "4", "--json", str(tmp_path / "run.json")])
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["memory"]["kv_pool_bytes"] >= 7 * 8192 * TINY_BYTES_PER_TOKEN
    with pytest.raises(SystemExit) as exit:
        llama3_naive.main([*TINY, "8"])
    assert exit.value.code == 1
